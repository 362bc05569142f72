#![no_main]
//! Fuzzes the JSON files of a model folder: `config.json` (text and both vision-language
//! layouts), `generation_config.json`, `tokenizer_config.json` and
//! `preprocessor_config.json`. Any input gives a config or an error naming the file.

use std::path::Path;

use ares_model::hf::config::ModelConfig;
use ares_model::hf::generation::GenerationConfig;
use ares_model::hf::tokenizer::TokenizerConfig;
use ares_model::vision::processor::ProcessorConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = ModelConfig::from_json_str(Path::new("config.json"), text);
    let _ = GenerationConfig::from_json_str(Path::new("generation_config.json"), text);
    if let Ok(json) = serde_json::from_str::<serde_json::Value>(text) {
        let _ = TokenizerConfig::from_json(json.clone(), Path::new("tokenizer_config.json"));
        let _ = ProcessorConfig::from_json(&json, Path::new("preprocessor_config.json"));
        if let Ok(model) = ModelConfig::from_json_str(Path::new("config.json"), text) {
            let _ = ares_model::model::ModelSpec::from_config(&model);
        }
    }
});
