//! [`TokenBatch`]: the response side of a step's samples as padded `[rows, T]` tensors, the
//! layout every ares-core token function takes (spec: "token tensors are `[rows, T]` padded
//! with a 0/1 mask, 1 on response tokens up to and including EOS").

use ares_core::Shape;

/// Padded per-token tensors of `rows` responses, `cols = T` = the longest response.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBatch {
    /// `[rows, cols]`.
    pub shape: Shape,
    /// 0/1 response mask.
    pub mask: Vec<f32>,
}

impl TokenBatch {
    /// The mask of responses of the given lengths, padded to the longest (at least 1 column
    /// so that shapes stay valid when every response is empty).
    pub fn from_lengths(lengths: &[usize]) -> Self {
        let rows = lengths.len();
        let cols = lengths.iter().copied().max().unwrap_or(0).max(1);
        let mut mask = vec![0.0f32; rows * cols];
        for (row, &len) in mask.chunks_exact_mut(cols).zip(lengths) {
            row[..len].fill(1.0);
        }
        Self {
            shape: Shape { rows, cols },
            mask,
        }
    }

    /// The mask of `responses`: 1 on the model's tokens (a multi-turn episode's tool and
    /// template tokens are 0, as padding is), padded to the longest response.
    pub fn from_responses(responses: &[crate::trainer::collect::rollout::Response]) -> Self {
        let lengths: Vec<usize> = responses.iter().map(|r| r.tokens.len()).collect();
        let mut batch = Self::from_lengths(&lengths);
        let cols = batch.shape.cols;
        for (row, r) in batch.mask.chunks_exact_mut(cols).zip(responses) {
            if let Some(m) = &r.from_model {
                for (x, &mine) in row.iter_mut().zip(m) {
                    if !mine {
                        *x = 0.0;
                    }
                }
            }
        }
        batch
    }

    /// Pads one vector per row into a `[rows, cols]` tensor (`fill` beyond each row).
    pub fn pad(&self, rows: &[Vec<f32>], fill: f32) -> Vec<f32> {
        let cols = self.shape.cols;
        let mut out = vec![fill; self.shape.rows * cols];
        for (dst, src) in out.chunks_exact_mut(cols).zip(rows) {
            let n = src.len().min(cols);
            dst[..n].copy_from_slice(&src[..n]);
        }
        out
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.shape.rows
    }

    /// Number of columns `T`.
    pub fn cols(&self) -> usize {
        self.shape.cols
    }

    /// Valid tokens of row `r`.
    pub fn row_len(&self, r: usize) -> usize {
        let c = self.shape.cols;
        self.mask[r * c..(r + 1) * c]
            .iter()
            .filter(|&&m| m != 0.0)
            .count()
    }

    /// The sub-batch of `rows` (in that order), keeping the column count so that every
    /// micro-batch of a step shares `T` (the `seq-mean-token-sum-norm` divisor).
    pub fn select(&self, rows: &[usize]) -> Self {
        Self {
            shape: Shape {
                rows: rows.len(),
                cols: self.shape.cols,
            },
            mask: gather_rows(&self.mask, self.shape.cols, rows),
        }
    }
}

/// Rows `rows` of a `[_, cols]` tensor, in that order.
pub fn gather_rows<T: Copy>(data: &[T], cols: usize, rows: &[usize]) -> Vec<T> {
    let mut out = Vec::with_capacity(rows.len() * cols);
    for &r in rows {
        out.extend_from_slice(&data[r * cols..(r + 1) * cols]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A two-turn episode: the model's call (3 tokens, its end-of-turn included), the
    /// tool turn (2), the model's answer (2). The mask — what the loss, the entropy
    /// statistics, HWE and the KL read — holds the model's 5 tokens; its length is 5.
    #[test]
    fn an_episode_masks_the_tools_tokens() {
        use crate::trainer::collect::rollout::Response;
        let episode = Response {
            tokens: vec![11, 12, 0, 90, 91, 13, 0],
            log_probs: vec![-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5],
            entropies: vec![1.0, 2.0, 3.0, 0.0, 0.0, 4.0, 5.0],
            finished: true,
            from_model: Some(vec![true, true, true, false, false, true, true]),
            interaction: None,
            tool_calls: 1,
        };
        let plain = Response {
            tokens: vec![7, 0],
            log_probs: vec![-0.1, -0.2],
            entropies: vec![1.0, 1.0],
            finished: true,
            from_model: None,
            interaction: None,
            tool_calls: 0,
        };
        let b = TokenBatch::from_responses(&[episode.clone(), plain.clone()]);
        assert_eq!((b.rows(), b.cols()), (2, 7));
        assert_eq!(
            b.mask,
            [
                1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, //
                1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0
            ]
        );
        assert_eq!((b.row_len(0), b.row_len(1)), (5, 2));
        assert_eq!((episode.model_len(), plain.model_len()), (5, 2));
        let h: Vec<f32> = episode.model_entropies().collect();
        assert_eq!(h, [1.0, 2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn pads_to_the_longest_response() {
        let b = TokenBatch::from_lengths(&[2, 0, 3]);
        assert_eq!(b.shape, Shape { rows: 3, cols: 3 });
        assert_eq!(b.mask, [1., 1., 0., 0., 0., 0., 1., 1., 1.]);
        assert_eq!(b.row_len(2), 3);
        let p = b.pad(&[vec![1.0, 2.0], vec![], vec![3.0, 4.0, 5.0]], -1.0);
        assert_eq!(p, [1., 2., -1., -1., -1., -1., 3., 4., 5.]);
        let s = b.select(&[2, 0]);
        assert_eq!(s.mask, [1., 1., 1., 1., 1., 0.]);
    }

    #[test]
    fn all_empty_keeps_one_column() {
        let b = TokenBatch::from_lengths(&[0, 0]);
        assert_eq!(b.shape, Shape { rows: 2, cols: 1 });
        assert_eq!(b.mask, [0., 0.]);
    }
}
