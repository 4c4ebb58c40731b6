//! `--quantized-kv-start`: moving a sequence's history from the dense staging pools into the
//! main pools, group by group, quantizing each row as a direct write would.

use super::*;

impl PagedKvCache {
    /// Moves a staging sequence's history into the main pools (quantizing it if the layer's
    /// format says so) and frees its staging blocks. Only the blocks a group still holds move
    /// (a window may have let go of the oldest); all-or-nothing over the groups.
    pub(super) fn promote(&mut self, id: SeqId) -> Result<()> {
        let s = self.seq(id)?.clone();
        for (g, table) in self.groups.iter().zip(&s.tables) {
            let n = table.iter().flatten().count();
            if n > g.room(Pool::Main) {
                return Err(CacheError::OutOfBlocks {
                    needed: n,
                    free: g.room(Pool::Main),
                    total: g.main.total,
                    window: g.window,
                });
            }
        }
        let bs = self.cfg.block_size;
        let mut tables = Vec::with_capacity(s.tables.len());
        for (g, table) in s.tables.iter().enumerate() {
            let new = self.take_main(g, table.iter().flatten().count())?;
            let mut new = new.into_iter();
            let moved: Vec<Option<u32>> =
                table.iter().map(|b| b.and_then(|_| new.next())).collect();
            // Positions of the held blocks, up to the sequence's length.
            let (mut src, mut dst) = (Vec::new(), Vec::new());
            for (b, (from, to)) in table.iter().zip(&moved).enumerate() {
                if let (Some(from), Some(to)) = (from, to) {
                    for p in b * bs..((b + 1) * bs).min(s.len) {
                        src.push(from * bs as u32 + (p % bs) as u32);
                        dst.push(to * bs as u32 + (p % bs) as u32);
                    }
                }
            }
            if !src.is_empty() {
                let n = src.len();
                let src = Tensor::from_vec(src, n, &self.device)?;
                let dst = SlotRows::new(dst);
                let gp = &self.groups[g];
                let staging = gp
                    .staging
                    .as_ref()
                    .expect("staging sequence has a staging pool");
                for (at, &l) in self.layout[g].layers.iter().enumerate() {
                    let from = &staging.layers[at];
                    let (k, v) = from.gather(&src, from.format().value_dtype())?;
                    let (k, v) = match self.rotation(l, true) {
                        Some(r) => (r.rotate(&k)?, r.rotate(&v)?),
                        None => (k, v),
                    };
                    gp.main.layers[at].write_slots(&dst, &k, &v)?;
                }
            }
            let gp = &mut self.groups[g];
            gp.give_back(Pool::Staging, table.iter().flatten().copied().collect());
            tables.push(moved);
        }
        let st = self.seqs.get_mut(&id).ok_or(CacheError::UnknownSeq(id))?;
        st.pool = Pool::Main;
        st.tables = tables;
        Ok(())
    }
}
