//! Multimodal rotary position ids (M-RoPE) of the Qwen2-VL family: under construction.
