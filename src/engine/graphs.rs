//! Decode steps as replayed CUDA graphs (docs/ARCHITECTURE.md, "One decode step").
//!
//! Launched one by one, a decode step of the default model costs several hundred kernel
//! launches of host time — more than the GPU needs to run them. Here a step's whole forward pass
//! (every layer, the logits and the greedy picks) is captured once per shape and replayed with
//! one launch: the host only writes the step's inputs into fixed buffers ([`FixedStep`]) and
//! reads back token ids.
//!
//! Shapes: the batch is padded up to a bucket (every size up to 8, then powers of two up to the
//! engine's `--max-batch`), and block tables to a power-of-two width (at least 16 blocks), so a
//! handful of graphs serve every step as sequences join, finish and grow. A shape's first step
//! runs eagerly (it loads kernels and sizes candle's scratch buffers) and is then captured;
//! later steps replay. Steps with prompt tokens, dense staging, mixed key/value widths other
//! than keys one bit wider than values on the warp kernel, attention soft-capping, or windowed
//! layers beside global ones (several layer groups) run eagerly as before, as does a sequence's
//! first step under `--kv-center` or `--kv-residual` before its means or device copies exist.
//! Under `--kv-residual` a step's rows go straight into the copies' rings (the host books them
//! after the replay), and graphs are captured again when the copies' pools grow. Outputs are
//! identical either way.

use anyhow::Result;
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::{DType, Tensor};
use std::collections::HashMap;

use super::device_greedy::{argmax_into, picks_of};
use crate::device::graph::{capture, kernel_nodes, replay};
use crate::kv::attend::{decode, FixedStep};
use crate::kv::cache::PagedKvCache;
use crate::model::llama::{Llama, SeqInput};

/// Narrowest block-table width a graph is captured for.
const MIN_WIDTH: usize = 16;
/// Graphs kept at most (each holds its own scratch memory); all are dropped past it.
const MAX_GRAPHS: usize = 64;

/// What a replayed step gives back.
pub struct GraphStep {
    /// Per sequence, its greedy pick (`None`: its logits hold a NaN).
    pub picks: Vec<Option<u32>>,
    /// Per sequence, its logits row, when asked for (sampling on the host).
    pub logits: Option<Vec<Vec<f32>>>,
}

/// One captured shape: its input buffers, its graph, and the buffers it writes.
struct Entry {
    step: FixedStep,
    graph: CudaGraph,
    /// u32 `[2 * rows]`: the picks, then the NaN flags.
    picks: Tensor,
    /// f32 `[rows, vocab]`.
    logits: Tensor,
}

/// The captured decode steps of one engine (they hold the addresses of its cache's pool).
pub struct DecodeGraphs {
    entries: HashMap<(usize, usize), Entry>,
    max_rows: usize,
    /// Most rows any forward pass of the engine takes (a prompt chunk plus the decode tokens
    /// beside it): candle's grow-only matmul scratch is sized for it before any capture.
    most_rows: usize,
    /// Scratch buffers grown to the largest shape before the first capture.
    warmed: bool,
    /// Set when a capture failed: every step runs eagerly from then on.
    broken: bool,
    /// Kernel nodes of the graph of the most rows captured: (rows, kernels).
    kernels: Option<(usize, usize)>,
    /// [`PagedKvCache::rings_moved`] when the graphs were captured.
    rings_moved: u64,
}

impl DecodeGraphs {
    pub fn new(max_batch: usize, prefill_chunk: usize) -> Self {
        let max_rows = bucket(max_batch.max(1), usize::MAX);
        DecodeGraphs {
            entries: HashMap::new(),
            max_rows,
            most_rows: max_rows.max(prefill_chunk + max_batch),
            warmed: false,
            broken: false,
            kernels: None,
            rings_moved: 0,
        }
    }

    /// Kernels one replayed step launches, for the graph of the most rows captured so far.
    pub fn kernels(&self) -> Option<usize> {
        self.kernels.map(|(_, k)| k)
    }

    /// Whether `inputs` form a step graphs can take: one new token per sequence, all in the
    /// main pool, on a CUDA device, every layer on the fused decode kernel.
    pub fn takes(&self, model: &Llama, cache: &PagedKvCache, inputs: &[SeqInput]) -> bool {
        let hd = cache.config().head_dim;
        let fused = |l: usize| {
            let f = cache.layer_storage(l, true).format();
            decode::cuda_fuses(&f, hd, model.dtype())
        };
        !self.broken
            && !inputs.is_empty()
            && cache.groups().len() == 1
            && inputs.len() <= self.max_rows
            && cache.device().is_cuda()
            && model.config().attn_softcap.is_none()
            && inputs
                .iter()
                .all(|i| i.tokens.len() == 1 && cache.in_main_pool(i.seq).unwrap_or(false))
            && (0..cache.config().num_layers).all(fused)
            && cache.fixed_ready(&inputs.iter().map(|i| i.seq).collect::<Vec<_>>())
    }

    /// Runs the decode step of `inputs` (see [`DecodeGraphs::takes`]) and advances the cache.
    pub fn step(
        &mut self,
        model: &Llama,
        inputs: &[SeqInput],
        cache: &mut PagedKvCache,
        want_logits: bool,
    ) -> Result<GraphStep> {
        let batch = model.begin(inputs, cache)?;
        let n = batch.slices.len();
        let blocks = batch
            .slices
            .iter()
            .map(|s| cache.block_table(s.seq, 0).map(|t| t.len()))
            .collect::<std::result::Result<Vec<_>, _>>()?
            .into_iter()
            .max()
            .unwrap_or(0);
        let key = (
            bucket(n, self.max_rows),
            blocks.next_power_of_two().max(MIN_WIDTH),
        );
        if !self.warmed {
            self.warm(model, cache, &batch, key.1)?;
        }
        // The device copies' pools moved: every graph reads the old ones.
        if self.rings_moved != cache.rings_moved() {
            self.entries.clear();
            self.rings_moved = cache.rings_moved();
        }
        match self.entries.get_mut(&key) {
            Some(e) => {
                e.step.fill(cache, &batch.slices, &batch.tokens)?;
                replay(&e.graph)?;
            }
            None => {
                if self.entries.len() >= MAX_GRAPHS {
                    self.entries.clear();
                }
                let mut step = FixedStep::new(cache, key.0, key.1, model.dtype())?;
                step.fill(cache, &batch.slices, &batch.tokens)?;
                let vocab = model.config().vocab_size;
                let picks = Tensor::zeros(2 * key.0, DType::U32, cache.device())?;
                let logits = Tensor::zeros((key.0, vocab), DType::F32, cache.device())?;
                // Candle uploads small parameter vectors (shapes, strides) for some kernels;
                // with its cache on, the eager run leaves them on the device, so the capture
                // reuses those copies instead of recording host-to-device copies (and a
                // capture that would need a new one fails instead of recording it).
                let candle_core::Device::Cuda(cuda) = cache.device() else {
                    anyhow::bail!("CUDA graphs need a CUDA device");
                };
                let _cached_params = cuda.enable_cuda_graph_htod_cache();
                // Eagerly first: loads every kernel and computes this step's outputs.
                run(model, &step, cache, &picks, &logits)?;
                match capture(cache.device(), || run(model, &step, cache, &picks, &logits)) {
                    Ok((graph, ())) => {
                        let k = kernel_nodes(&graph)?;
                        if self.kernels.is_none_or(|(rows, _)| rows <= key.0) {
                            self.kernels = Some((key.0, k));
                        }
                        self.entries.insert(
                            key,
                            Entry {
                                step,
                                graph,
                                picks,
                                logits,
                            },
                        );
                    }
                    Err(e) => {
                        eprintln!("kvq: CUDA graph capture failed ({e}); decoding without graphs");
                        self.broken = true;
                        return finish(model, cache, &batch.slices, &picks, &logits, want_logits);
                    }
                }
            }
        }
        let e = &self.entries[&key];
        finish(
            model,
            cache,
            &batch.slices,
            &e.picks,
            &e.logits,
            want_logits,
        )
    }

    /// Before the first capture: every grow-only scratch buffer gets its final size and
    /// address, so none moves under a captured graph — candle's quantized-matmul workspaces by
    /// the engine's largest forward pass ([`Llama::warm_matmuls`]), then one eager step at the
    /// largest batch and at 8 rows (where candle's mat-vec kernels take over) for the rest
    /// (the decode kernel's counters). Those steps' rows repeat the step's first sequence:
    /// they rewrite its new K/V with the same values and their outputs are dropped.
    fn warm(
        &mut self,
        model: &Llama,
        cache: &PagedKvCache,
        batch: &crate::model::llama::Batch,
        width: usize,
    ) -> Result<()> {
        model.warm_matmuls(self.most_rows)?;
        let first = &batch.slices[..1];
        let token = &batch.tokens[..1];
        for rows in [self.max_rows.min(8), self.max_rows] {
            let mut step = FixedStep::new(cache, rows, width, model.dtype())?;
            step.fill(cache, first, token)?;
            drop(model.forward_fixed(&step, cache)?);
        }
        self.warmed = true;
        Ok(())
    }
}

/// The captured work: the forward pass, the picks into `picks`, the logits into `logits`. Every
/// tensor it creates is dropped before it returns.
fn run(
    model: &Llama,
    step: &FixedStep,
    cache: &PagedKvCache,
    picks: &Tensor,
    logits: &Tensor,
) -> candle_core::Result<()> {
    let l = model
        .forward_fixed(step, cache)
        .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
    argmax_into(&l, picks)?;
    logits.slice_set(&l, 0, 0)
}

/// Reads the step's outputs back and advances the cache by one token per sequence.
fn finish(
    model: &Llama,
    cache: &mut PagedKvCache,
    slices: &[crate::kv::attend::SeqSlice],
    picks: &Tensor,
    logits: &Tensor,
    want_logits: bool,
) -> Result<GraphStep> {
    let n = slices.len();
    let rows = picks.dim(0)? / 2;
    let all: Vec<u32> = picks.to_vec1()?;
    let both: Vec<u32> = all[..n]
        .iter()
        .chain(&all[rows..rows + n])
        .copied()
        .collect();
    let picks = picks_of(&both, model.config().vocab_size);
    let logits = match want_logits {
        true => Some(logits.narrow(0, 0, n)?.to_vec2()?),
        false => None,
    };
    let rows: Vec<_> = slices.iter().map(|s| (s.seq, s.start)).collect();
    cache.fixed_done(&rows);
    for s in slices {
        cache.advance(s.seq, s.n)?;
    }
    Ok(GraphStep { picks, logits })
}

/// The batch size a step of `n` sequences is padded to: `n` up to 8, then the next power of
/// two, at most `max` (itself a bucket).
fn bucket(n: usize, max: usize) -> usize {
    let b = if n <= 8 { n } else { n.next_power_of_two() };
    b.min(max)
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets_are_exact_to_eight_then_powers_of_two() {
        let got: Vec<usize> = [1, 2, 7, 8, 9, 16, 17, 33, 64, 65]
            .iter()
            .map(|&n| bucket(n, usize::MAX))
            .collect();
        assert_eq!(got, [1, 2, 7, 8, 16, 16, 32, 64, 64, 128]);
        // Capped by the engine's largest bucket.
        assert_eq!(bucket(40, bucket(48, usize::MAX)), 64);
        assert_eq!(bucket(40, 48), 48);
    }
}
