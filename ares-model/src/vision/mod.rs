//! The vision side of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): the image and video
//! processor (pixels → patch rows and grids), the multimodal rotary positions (M-RoPE),
//! the config and checkpoint of a vision-language model, its vision tower, and
//! [`model::VlModel`], which joins the tower to the language model.

pub mod checkpoint;
pub mod config;
mod half_grads;
pub mod lora;
pub mod model;
pub mod mrope;
pub mod optim_file;
pub mod processor;
pub mod tower;
mod tower_lora;
pub mod video;
pub mod weights;
