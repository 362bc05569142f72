#![no_main]
//! Fuzzes the YAML config with dotted overrides (`ares_runner::config`), EasyR1's key rules
//! included: the first line-separated part is the file, the rest are overrides. Any input
//! must give a config or an error, never a panic.

use ares_runner::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (file, overrides) = text.split_once("\n---overrides---\n").unwrap_or((text, ""));
    let _ = Config::from_yaml_str(file, "fuzz.yaml");
    let overrides: Vec<String> = overrides.lines().map(str::to_string).collect();
    if let Ok(config) = Config::load(None, &overrides) {
        // what resolves writes out and loads back
        let _ = Config::from_yaml_str(&config.to_yaml(), "resolved");
    }
});
