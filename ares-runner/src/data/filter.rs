//! Prompt-length filtering (`data.max_prompt_length` with `filter_overlong_prompts`): prompts
//! longer than the limit are dropped before training rather than truncated, since a cut
//! question has no well-defined answer.

use super::error::{DataError, Result};
use super::example::Example;

/// Keeps the examples whose prompt length (`lengths[i]` tokens for `examples[i]`, as the
/// caller measured it after templating) is at most `max`; returns them in order with the
/// number dropped.
///
/// Errors: `lengths.len() ≠ examples.len()` ([`DataError::LengthCount`]); every prompt too
/// long ([`DataError::AllTooLong`], naming the shortest length).
pub fn filter_by_prompt_length(
    examples: Vec<Example>,
    lengths: &[usize],
    max: usize,
) -> Result<(Vec<Example>, usize)> {
    if lengths.len() != examples.len() {
        return Err(DataError::LengthCount {
            examples: examples.len(),
            lengths: lengths.len(),
        });
    }
    let total = examples.len();
    let kept: Vec<Example> = examples
        .into_iter()
        .zip(lengths)
        .filter(|&(_, &l)| l <= max)
        .map(|(e, _)| e)
        .collect();
    if kept.is_empty() && total > 0 {
        return Err(DataError::AllTooLong {
            max,
            shortest: lengths.iter().copied().min().unwrap_or(0),
        });
    }
    let dropped = total - kept.len();
    Ok((kept, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Prompt;

    fn ex(id: &str) -> Example {
        Example {
            global_id: id.into(),
            prompt: Prompt::Text(id.into()),
            answer: "1".into(),
            difficulty: None,
            rubrics: vec![],
            row: 0,
            images: vec![],
            videos: vec![],
            tools_kwargs: None,
            interaction_kwargs: None,
        }
    }

    #[test]
    fn keeps_at_most_max_in_order() {
        let exs = vec![ex("a"), ex("b"), ex("c"), ex("d")];
        let (kept, dropped) = filter_by_prompt_length(exs, &[3, 5, 4, 6], 4).unwrap();
        let ids: Vec<_> = kept.iter().map(|e| e.global_id.as_str()).collect();
        assert_eq!(ids, ["a", "c"]);
        assert_eq!(dropped, 2);
    }

    #[test]
    fn errors() {
        let e = filter_by_prompt_length(vec![ex("a")], &[1, 2], 4).unwrap_err();
        assert!(matches!(
            e,
            DataError::LengthCount {
                examples: 1,
                lengths: 2
            }
        ));
        let e = filter_by_prompt_length(vec![ex("a"), ex("b")], &[9, 7], 4).unwrap_err();
        assert!(e.to_string().contains("max_prompt_length = 4"), "{e}");
        assert!(e.to_string().contains("shortest has 7"), "{e}");
        assert_eq!(filter_by_prompt_length(vec![], &[], 4).unwrap().1, 0);
    }
}
