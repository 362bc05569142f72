#![no_main]
//! Fuzzes the weight files of a model folder through `TensorFiles`: the input is written as
//! `model.safetensors` (or, after a 0 byte, as `model.safetensors.index.json` beside a small
//! valid shard) and every tensor it declares is read: tensors or an error naming the file,
//! never a read past the file.

use ares_model::hf::tensor_files::TensorFiles;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("ares-fuzz-st-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    match data.split_first() {
        Some((0, index)) => {
            // a valid one-tensor shard the index may or may not point at
            let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
            let mut shard = (header.len() as u64).to_le_bytes().to_vec();
            shard.extend_from_slice(header);
            shard.extend_from_slice(&[0u8; 8]);
            let _ = std::fs::write(dir.join("model-00001-of-00001.safetensors"), shard);
            let _ = std::fs::write(dir.join("model.safetensors.index.json"), index);
        }
        _ => {
            let _ = std::fs::write(dir.join("model.safetensors"), data);
        }
    }
    let Ok(files) = TensorFiles::open(&dir) else {
        return;
    };
    let names: Vec<String> = files.names().map(str::to_string).collect();
    for name in names.iter().take(8) {
        if let Some((_, shape)) = files.shape(name)
            && shape.iter().product::<usize>() <= 1 << 16
        {
            let _ = files.read_f32(name);
        }
    }
});
