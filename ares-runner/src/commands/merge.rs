//! `ares-runner merge`: a PEFT LoRA adapter merged into its base model, written as a full
//! Hugging Face checkpoint (`W ← W + s·B·A` for every adapted weight, as peft's
//! `merge_and_unload`), with the base model's tokenizer and generation config.
//!
//! Text models (Qwen2, Qwen3, Llama) and the language model of a vision-language one
//! (Qwen2-VL, Qwen2.5-VL: written in the layout it was read in, with its processor files).
//! The output directory must not exist or be empty, and is never the base model's own: a
//! merge never writes over its input.

use std::path::{Path, PathBuf};

use crate::hf::tensor_files::SaveDtype;
use crate::trainer::TrainError;
use crate::trainer::setup::{ModelFiles, copy_tokenizer_files};

/// What `merge` read and wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeReport {
    /// Weights the adapter changed.
    pub merged: usize,
    /// Its rank and scale `s`.
    pub rank: usize,
    /// `lora_alpha / r` (or `/ √r`).
    pub scale: f64,
    /// The directory written.
    pub output: PathBuf,
}

/// Merges the adapter in `adapter` into the model in `model` and writes the result to
/// `output` in `dtype`.
///
/// # Errors
/// `output` the base model's directory or a non-empty one; the model or adapter missing,
/// malformed or not matching (named by the reader); I/O errors.
pub fn merge(
    model: &Path,
    adapter: &Path,
    output: &Path,
    dtype: SaveDtype,
) -> Result<MergeReport, TrainError> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(model, output) || same(adapter, output) {
        return Err(TrainError::Invalid(format!(
            "merge: --output {} is an input directory; write the merged model elsewhere",
            output.display()
        )));
    }
    if std::fs::read_dir(output).is_ok_and(|mut d| d.next().is_some()) {
        return Err(TrainError::Invalid(format!(
            "merge: --output {} exists and is not empty; choose a new directory",
            output.display()
        )));
    }
    let hf = |e: crate::hf::HfError| TrainError::Model(e.into());
    let mut files = ModelFiles::load(model)?;
    let lora = files.merge_adapter(adapter)?;
    match &files {
        ModelFiles::Text(c) => c.save(output, dtype).map_err(hf)?,
        ModelFiles::Vision(c) => c.save(output, dtype, c.layout).map_err(hf)?,
    }
    copy_tokenizer_files(model, output)?;
    Ok(MergeReport {
        merged: lora.pairs.len(),
        rank: lora.config.r,
        scale: lora.config.scale(),
        output: output.to_path_buf(),
    })
}
