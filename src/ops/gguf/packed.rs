//! A GGUF weight matrix with its block headers and codes stored apart: the same bytes as the
//! file's blocks, rearranged once at load.
//!
//! Why: a kernel needs each block's scale (and offset) as broadcast f32 values and its codes as
//! vectors. In GGUF order the two alternate every 18–34 bytes, so every block costs a scalar
//! f16 load, conversion and broadcast per weight row — as many instructions as widening its 32
//! codes. Apart, the headers of a run of rows are one contiguous array of f16 (for the 32-element
//! types) that converts sixteen at a time ([`super::kernel`]'s parameter pass), and the codes of a run of rows
//! are one contiguous stream (16-byte aligned for 16-byte codes) that prefetches as one.

use super::blocks::Block;

/// Rows of blocks of `B`, headers and codes apart (row-major in both).
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    /// Codes: row r's blocks at `r · blocks · CODES`. Stored as u128 for 16-byte alignment.
    codes: Vec<u128>,
    /// Headers: row r's blocks at `r · blocks · HEAD`.
    heads: Vec<u8>,
    code_bytes: usize,
}

impl Packed {
    /// Splits `data`, `rows` rows of `blocks` GGUF blocks of `B`.
    pub(crate) fn split<B: Block>(data: &[u8], rows: usize, blocks: usize) -> Packed {
        let n = rows * blocks;
        assert_eq!(
            data.len(),
            n * B::BYTES,
            "GGUF data of {rows}x{blocks} blocks"
        );
        let code_bytes = n * B::CODES;
        let mut codes = vec![0u128; code_bytes.div_ceil(16)];
        let mut heads = vec![0u8; n * B::HEAD];
        {
            // SAFETY: the u128 buffer holds at least `code_bytes` bytes; u8 has no alignment.
            let c = unsafe {
                std::slice::from_raw_parts_mut(codes.as_mut_ptr().cast::<u8>(), code_bytes)
            };
            for ((blk, h), q) in data
                .chunks_exact(B::BYTES)
                .zip(heads.chunks_exact_mut(B::HEAD))
                .zip(c.chunks_exact_mut(B::CODES))
            {
                B::split(blk, h, q);
            }
        }
        Packed {
            codes,
            heads,
            code_bytes,
        }
    }

    /// The rows of `parts` one after the other (each a matrix of the same block type and row
    /// length): the stacked matrix's rows are the parts' rows, byte for byte.
    pub(crate) fn stack(parts: &[&Packed]) -> Packed {
        let code_bytes = parts.iter().map(|p| p.code_bytes).sum::<usize>();
        let mut bytes = Vec::with_capacity(code_bytes);
        let mut heads = Vec::with_capacity(parts.iter().map(|p| p.heads.len()).sum());
        for p in parts {
            bytes.extend_from_slice(p.codes());
            heads.extend_from_slice(&p.heads);
        }
        let mut codes = vec![0u128; code_bytes.div_ceil(16)];
        // SAFETY: as in `split`.
        unsafe { std::slice::from_raw_parts_mut(codes.as_mut_ptr().cast::<u8>(), code_bytes) }
            .copy_from_slice(&bytes);
        Packed {
            codes,
            heads,
            code_bytes,
        }
    }

    /// All codes.
    pub(crate) fn codes(&self) -> &[u8] {
        // SAFETY: the u128 buffer holds at least `code_bytes` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.codes.as_ptr().cast::<u8>(), self.code_bytes) }
    }

    /// All headers.
    pub(crate) fn heads(&self) -> &[u8] {
        &self.heads
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.code_bytes + self.heads.len()
    }
}
