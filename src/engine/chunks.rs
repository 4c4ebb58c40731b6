//! How a prompt is cut into the chunks its prefill steps take.
//!
//! Two rules: a prompt longer than one token never gets a one-token chunk nor is left with a
//! one-token rest (see [`prefill_take`]), and a prompt may have one *stop point*, a block
//! boundary its prefill must end a step on, so that the cache can keep there what a later
//! sequence starting at that point needs (`--kv-residual`'s dense copies:
//! [`crate::kv::cache::PagedKvCache::prefix_point`]). Results do not depend on where chunks end,
//! so neither rule changes a token.

/// Prompt tokens to prefill in this step for a prompt of `len` tokens with `prefilled` done,
/// `budget` free of a total chunk of `chunk`, stopping at `point` when it lies ahead.
pub fn chunk_take(
    len: usize,
    prefilled: usize,
    point: Option<usize>,
    budget: usize,
    chunk: usize,
) -> usize {
    let stop = point.filter(|&p| p > prefilled && p < len).unwrap_or(len);
    prefill_take(stop - prefilled, budget, chunk)
}

/// Prompt tokens of a request to prefill in this step, `left` still to go and `budget` free.
/// As many as fit, except that a prompt longer than one token never gets a one-token chunk nor
/// is left with a one-token rest: a lone new token takes the decode kernel, whose rounding
/// differs from the prefill path that the same token takes when the prompt runs alone, so a
/// prompt's K/V would depend on how the batch happened to split it. With a total chunk of
/// fewer than 3 tokens this cannot be kept (it would stall) and plain splitting applies.
pub fn prefill_take(left: usize, budget: usize, chunk: usize) -> usize {
    if left <= budget || chunk < 3 {
        return left.min(budget);
    }
    let n = if left - budget == 1 {
        budget - 1
    } else {
        budget
    };
    if n < 2 {
        0
    } else {
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_chunks_are_never_single_tokens() {
        assert_eq!(prefill_take(10, 64, 64), 10);
        assert_eq!(prefill_take(1, 64, 64), 1); // a one-token prompt
        assert_eq!(prefill_take(100, 32, 32), 32);
        assert_eq!(prefill_take(33, 32, 32), 31); // not 32, which would leave 1
        assert_eq!(prefill_take(40, 1, 32), 0); // wait for a step with room
        assert_eq!(prefill_take(3, 2, 32), 0); // 2 would leave 1, 1 is alone
        assert_eq!(prefill_take(5, 3, 32), 3);
        // Every split of any prompt under any budget is made of chunks of ≥ 2 tokens.
        for len in 2..80 {
            for first_budget in 0..40 {
                let (mut left, mut budget) = (len, first_budget);
                let mut steps = 0;
                while left > 0 {
                    let n = prefill_take(left, budget, 32);
                    assert!(n != 1, "len {len}: a one-token chunk");
                    left -= n;
                    budget = 32;
                    steps += 1;
                    assert!(steps < 100);
                }
            }
        }
        // Tiny chunks cannot avoid it; they still make progress.
        assert_eq!(prefill_take(3, 2, 2), 2);
        assert_eq!(prefill_take(3, 1, 1), 1);
    }

    /// A prompt with a stop point ends a step exactly there (whatever the budgets), and still
    /// never takes a one-token chunk.
    #[test]
    fn a_stop_point_ends_a_step_and_chunks_stay_whole() {
        for len in 4..90 {
            for point in [16, 32, 48, 64] {
                if point + 2 > len {
                    continue;
                }
                for first_budget in 0..40 {
                    let (mut done, mut budget, mut stops) = (0, first_budget, Vec::new());
                    while done < len {
                        let n = chunk_take(len, done, Some(point), budget, 32);
                        assert!(n != 1, "len {len} point {point}: a one-token chunk");
                        done += n;
                        stops.push(done);
                        budget = 32;
                        assert!(stops.len() < 100);
                    }
                    assert!(stops.contains(&point), "len {len}: {stops:?} skip {point}");
                }
            }
        }
        // A point behind or at the end changes nothing.
        assert_eq!(chunk_take(40, 20, Some(16), 64, 64), 20);
        assert_eq!(chunk_take(40, 0, Some(40), 64, 64), 40);
        assert_eq!(chunk_take(40, 0, Some(16), 64, 64), 16);
    }
}
