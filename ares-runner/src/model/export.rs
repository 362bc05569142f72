//! The model's weights back on the host: [`Model::to_weights`] downloads every parameter
//! under its Hugging Face name and shape.

use std::collections::HashMap;

use super::{Model, ModelError};
use crate::backend::Backend;
use crate::hf::weights::{ModelWeights, Tensor, expected_tensors};

impl<B: Backend> Model<B> {
    /// Every parameter copied to the host as [`ModelWeights`] (f32, the master copy, so a
    /// model loaded from bf16 comes back as the f32 values it computes with; tied
    /// embeddings come back as `embed_tokens` only).
    ///
    /// # Errors
    /// A backend failure.
    pub fn to_weights(&self) -> Result<ModelWeights, ModelError> {
        let mut map = HashMap::new();
        for (name, shape) in expected_tensors(&self.config) {
            let t = self.weights.tensor(&name)?;
            let mut data = vec![0.0f32; t.len()];
            self.backend.download(t, &mut data)?;
            map.insert(name, Tensor { shape, data });
        }
        Ok(ModelWeights::from_map(&self.config, map)?)
    }
}
