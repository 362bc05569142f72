#![no_main]
//! Fuzzes dataset rows through the loader: the input is written as a `.jsonl` file (and, when
//! it starts with `PAR1`, as a `.parquet` file) and loaded with the prompt, answer, rubric and
//! media columns: examples or an error naming the file and row, never a panic.

use ares_runner::data::{DataKeys, MediaKeys, load_dataset_with_media};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // the loader catches the `parquet` crate's panics on malformed files and reports them
    // as errors; libFuzzer's hook would abort on them first, so the default hook is back
    // (a panic that reaches the harness still aborts there)
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let _ = std::panic::take_hook();
    });
    let dir = std::env::temp_dir().join(format!("ares-fuzz-rows-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let name = if data.starts_with(b"PAR1") {
        "rows.parquet"
    } else {
        "rows.jsonl"
    };
    let path = dir.join(name);
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let _ = load_dataset_with_media(&path, &DataKeys::default(), &MediaKeys::default());
});
