//! The vision side of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): the image and video
//! processor (pixels → patch rows and grids) and the multimodal rotary positions (M-RoPE).

pub mod mrope;
pub mod processor;
