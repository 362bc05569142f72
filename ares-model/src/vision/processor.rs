//! The Qwen2-VL image and video processor: under construction.
