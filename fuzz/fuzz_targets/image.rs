#![no_main]
//! Fuzzes image decoding and the Qwen2-VL processor on arbitrary bytes: a PNG, JPEG or WebP
//! (or anything else) decodes, within the pixel limit, or gives an error naming the file;
//! a decoded image goes through resizing and patching.

use std::path::Path;

use ares_model::vision::processor::{ProcessorConfig, decode_rgb, process_image};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(image) = decode_rgb(data, Path::new("fuzz.png")) else {
        return;
    };
    // small images only through the processor: resizing a large one is slow, not wrong
    if image.height * image.width <= 1 << 16 {
        let _ = process_image(&image, &ProcessorConfig::default());
    }
});
