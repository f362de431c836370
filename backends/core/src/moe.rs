//! The host's part of routed experts on a device backend: from the ids `moe_route` chose (read
//! back, `k` a token), which rows each expert serves, expert by expert in token order, so that
//! every expert runs once over one contiguous group (never a loop over tokens); and the shape
//! check of the experts' matrices every backend makes before a MoE FFN.

use crate::BackendError;

/// The rows of a step grouped by the expert they are routed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertGroups {
    /// Rows routed to each expert.
    pub counts: Vec<usize>,
    /// First grouped row of each expert (`counts` summed before it).
    pub starts: Vec<usize>,
    /// Grouped row g holds token `rows[g]`: the gather's index list.
    pub rows: Vec<i32>,
    /// Slot j of token r is grouped row `pos[r * k + j]`: where the weighted sum finds it.
    pub pos: Vec<i32>,
}

impl ExpertGroups {
    /// Groups `ids` (rows of `k`, each an expert below `n_experts`); an id out of range is an
    /// error of `op` naming the token.
    pub fn plan(
        op: &'static str,
        ids: &[i32],
        k: usize,
        n_experts: usize,
    ) -> Result<Self, BackendError> {
        let mut counts = vec![0usize; n_experts];
        for (i, &e) in ids.iter().enumerate() {
            let c = usize::try_from(e)
                .ok()
                .and_then(|e| counts.get_mut(e))
                .ok_or_else(|| BackendError::BadArgument {
                    op,
                    message: format!(
                        "token {} is routed to expert {e} of {n_experts}",
                        i / k.max(1)
                    ),
                })?;
            *c += 1;
        }
        let mut starts = Vec::with_capacity(n_experts);
        let mut at = 0;
        for &c in &counts {
            starts.push(at);
            at += c;
        }
        let mut next = starts.clone();
        let mut rows = vec![0i32; ids.len()];
        let mut pos = vec![0i32; ids.len()];
        for (i, &e) in ids.iter().enumerate() {
            let g = next[e as usize];
            next[e as usize] += 1;
            rows[g] = (i / k.max(1)) as i32;
            pos[i] = g as i32;
        }
        Ok(Self {
            counts,
            starts,
            rows,
            pos,
        })
    }

    /// The experts with rows: (expert, first grouped row, rows).
    pub fn active(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.counts.len())
            .filter(|&e| self.counts[e] > 0)
            .map(|e| (e, self.starts[e], self.counts[e]))
    }
}

/// Checks the experts' matrices (`(inputs, outputs)` of each gate+up, then of each down) against
/// a hidden width `h` and an expert FFN width `ff`.
pub fn check_expert_shapes(
    op: &'static str,
    gate_up: impl ExactSizeIterator<Item = (usize, usize)>,
    down: impl ExactSizeIterator<Item = (usize, usize)>,
    h: usize,
    ff: usize,
) -> Result<(), BackendError> {
    let bad = |message: String| BackendError::BadArgument { op, message };
    if gate_up.len() != down.len() || gate_up.len() == 0 {
        return Err(bad(format!(
            "{} gate/up and {} down experts",
            gate_up.len(),
            down.len()
        )));
    }
    for (e, ((gk, gn), (dk, dn))) in gate_up.zip(down).enumerate() {
        if gk != h || gn != 2 * ff || dk != ff || dn != h {
            return Err(bad(format!(
                "expert {e} is {gk}x{gn} then {dk}x{dn}, expected {h}x{} then {ff}x{h}",
                2 * ff
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_experts_then_tokens() {
        // 3 tokens, k = 2, 4 experts: (2,0) (0,3) (2,1).
        let g = ExpertGroups::plan("t", &[2, 0, 0, 3, 2, 1], 2, 4).unwrap();
        assert_eq!(g.counts, vec![2, 1, 2, 1]);
        assert_eq!(g.starts, vec![0, 2, 3, 5]);
        assert_eq!(g.rows, vec![0, 1, 2, 0, 2, 1]);
        assert_eq!(g.pos, vec![3, 0, 1, 5, 4, 2]);
        assert_eq!(g.active().count(), 4);
        let e = ExpertGroups::plan("t", &[0, 4], 2, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expert 4 of 4"), "{e}");
        assert!(ExpertGroups::plan("t", &[-1, 0], 2, 4).is_err());
    }

    #[test]
    fn expert_shapes_are_checked() {
        let ok = [(64, 64), (64, 64)];
        let down = [(32, 64), (32, 64)];
        check_expert_shapes("t", ok.into_iter(), down.into_iter(), 64, 32).unwrap();
        let bad = [(32, 64), (33, 64)];
        let e = check_expert_shapes("t", ok.into_iter(), bad.into_iter(), 64, 32).unwrap_err();
        assert!(e.to_string().contains("expert 1"), "{e}");
    }
}
