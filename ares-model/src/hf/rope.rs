//! Rotary position embedding settings, normalised from either way `config.json` writes them:
//!
//! * old style (transformers 4.x): `rope_theta` at the top level, plus an optional
//!   `rope_scaling` object (`{"rope_type": "llama3", "factor": 8.0, ...}`; older files say
//!   `"type"` instead of `"rope_type"`);
//! * new style (transformers 5): one `rope_parameters` object holding `rope_theta`,
//!   `rope_type` and the scaling fields.

use serde_json::{Map, Value};

use super::HfError;
use super::json::Fields;

/// The RoPE settings of a model: base frequency and frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// Base of the inverse frequencies, `inv_freq[i] = theta^(-2i/head_dim)`.
    pub theta: f64,
    /// How the inverse frequencies are rescaled for long contexts.
    pub scaling: RopeScaling,
}

/// Frequency scaling of RoPE (`rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `default`: no scaling.
    Default,
    /// `linear`: positions divided by `factor` (all frequencies divided by `factor`).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `llama3`: low frequencies divided by `factor`, high ones kept, a smooth ramp between
    /// (wavelengths measured against `original_max_position_embeddings`).
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
    /// Any other `rope_type` (`yarn`, `dynamic`, `longrope`, ...): recorded so the model can
    /// refuse it with a clear message; the loader itself accepts it.
    Other {
        /// The `rope_type` as written.
        rope_type: String,
    },
}

impl RopeScaling {
    /// The `rope_type` name transformers uses.
    pub fn rope_type(&self) -> &str {
        match self {
            Self::Default => "default",
            Self::Linear { .. } => "linear",
            Self::Llama3 { .. } => "llama3",
            Self::Other { rope_type } => rope_type,
        }
    }
}

impl Rope {
    /// Reads the RoPE settings from the top-level fields of `config.json`.
    pub(crate) fn from_fields(f: &Fields<'_>) -> Result<Self, HfError> {
        if let Some(p) = f.object("rope_parameters")? {
            // A per-layer-type map ({"full_attention": {...}, ...}) is another model family.
            let theta: f64 = p.req("rope_theta")?;
            if let Some(top) = f.opt::<f64>("rope_theta")?
                && top != theta
            {
                return Err(f.error(
                    "rope_theta",
                    format!("{top} contradicts rope_parameters.rope_theta = {theta}"),
                ));
            }
            let rope = Self {
                theta,
                scaling: scaling(&p)?,
            };
            rope.check(&p)?;
            return Ok(rope);
        }
        let theta = f.opt::<f64>("rope_theta")?.unwrap_or(10_000.0);
        let scaling = match f.object("rope_scaling")? {
            Some(s) => scaling(&s)?,
            None => RopeScaling::Default,
        };
        let rope = Self { theta, scaling };
        rope.check(f)?;
        Ok(rope)
    }

    fn check(&self, f: &Fields<'_>) -> Result<(), HfError> {
        if !(self.theta.is_finite() && self.theta > 0.0) {
            return Err(f.error("rope_theta", format!("must be > 0, found {}", self.theta)));
        }
        if let Some(p) = f.opt::<f64>("partial_rotary_factor")?
            && p != 1.0
        {
            return Err(f.error(
                "partial_rotary_factor",
                format!("{p} is not supported (only full rotary embeddings, 1.0)"),
            ));
        }
        Ok(())
    }

    /// Writes these settings in the old style (`rope_theta` + `rope_scaling`), which
    /// transformers 4.x reads and 5.x converts. A `rope_parameters` object already in `map`
    /// is kept (and agrees, since it is where these settings came from).
    pub(crate) fn write_legacy(&self, map: &mut Map<String, Value>) {
        map.insert("rope_theta".into(), Value::from(self.theta));
        let scaling = match &self.scaling {
            RopeScaling::Default => None,
            RopeScaling::Linear { factor } => {
                Some(serde_json::json!({"rope_type": "linear", "factor": factor}))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => Some(serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            })),
            // Unknown scalings are copied through untouched: whatever the source had.
            RopeScaling::Other { rope_type } => {
                let from_params = map
                    .get("rope_parameters")
                    .and_then(Value::as_object)
                    .map(|p| {
                        let mut p = p.clone();
                        p.remove("rope_theta");
                        Value::Object(p)
                    });
                from_params
                    .or_else(|| map.get("rope_scaling").cloned())
                    .or_else(|| Some(serde_json::json!({ "rope_type": rope_type })))
            }
        };
        map.insert("rope_scaling".into(), scaling.unwrap_or(Value::Null));
    }
}

/// The scaling described by a `rope_scaling` or `rope_parameters` object.
fn scaling(s: &Fields<'_>) -> Result<RopeScaling, HfError> {
    let rope_type = match s.opt::<String>("rope_type")? {
        Some(t) => t,
        None => s
            .opt::<String>("type")?
            .unwrap_or_else(|| "default".to_string()),
    };
    let positive = |key: &str| -> Result<f64, HfError> {
        let v: f64 = s.req(key)?;
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(s.error(key, format!("must be > 0, found {v}")))
        }
    };
    Ok(match rope_type.as_str() {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: positive("factor")?,
        },
        "llama3" => {
            let low_freq_factor = positive("low_freq_factor")?;
            let high_freq_factor = positive("high_freq_factor")?;
            if high_freq_factor <= low_freq_factor {
                return Err(s.error(
                    "high_freq_factor",
                    format!("{high_freq_factor} must be > low_freq_factor = {low_freq_factor}"),
                ));
            }
            let original: usize = s.req("original_max_position_embeddings")?;
            if original == 0 {
                return Err(s.error("original_max_position_embeddings", "must be > 0, found 0"));
            }
            RopeScaling::Llama3 {
                factor: positive("factor")?,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: original,
            }
        }
        _ => RopeScaling::Other { rope_type },
    })
}
