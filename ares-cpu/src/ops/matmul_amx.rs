//! bf16 matrix products on AMX tiles: what [`MatmulPrecision::Bf16`] runs on the CPU's
//! [`Isa::Amx`] path (Intel Xeon Sapphire Rapids and later).
//!
//! The arithmetic is a tensor core's, as the emulation on the other paths: each operand
//! element rounded to bf16 (nearest, ties to even), the products exact, the sums in f32.
//! `tdpbf16ps` adds each pair of products `a[i, 2p]·b[2p, j] + a[i, 2p+1]·b[2p+1, j]` into
//! an f32 accumulator, one pair after the other along `k`, so only the order of the f32
//! sums differs from the emulated path's — and the hardware flushes subnormal operands
//! and results to zero (below 1.2e-38: nothing a model's activations or gradients reach).
//! Every element of `c` is summed by one tile product in `k` order, whatever the number of
//! threads: the same bits for any thread count.
//!
//! The operands are packed (and rounded) once per product into the tiles' layouts:
//! - `a` `[n, k]`: 16-row × 32-column tiles, a row's 32 bf16 contiguous (64 bytes);
//! - `b` `[k, m]`: 16 pairs of rows × 16 columns, each column's pair `(b[2p, j], b[2p+1, j])`
//!   adjacent (the layout `tdpbf16ps` reads: its "VNNI" format);
//!
//! zero-padded to whole 32 × 32 blocks of `c`, which one call of the tile kernel computes
//! with four accumulator tiles over the whole of `k`. A block's two strips are interleaved
//! tile by tile, so each step of the kernel reads 2 KiB of `a` and 2 KiB of `b` in a row
//! (from L2 at full speed: the tile loads are not what limits it).
//!
//! What limits a product with a shallow `k` (a model of hidden size 256: 32 blocks' sums
//! for every 8 tile steps) is writing `c`. The tiles store a row block's sums into a
//! 32 KiB panel (the task's 256 columns), and the panel is written out 16 lanes at a time:
//! `β·c + α·sums`, or, for a `c` written whole that is larger than a core's L2, straight
//! to memory with streaming stores (a row's whole 64-byte lines; its partial first and
//! last lines as usual). A cached store first reads the line it writes; on this path that
//! doubled the memory traffic and halved the speed of the LM head's forward product.
//!
//! Linux hands the tile registers' state to a process only on request (`arch_prctl`
//! `ARCH_REQ_XCOMP_PERM`); [`available`] asks once and the path exists only if granted.
//!
//! [`MatmulPrecision::Bf16`]: crate::ops::precision::MatmulPrecision::Bf16
//! [`Isa::Amx`]: crate::isa::Isa::Amx

use crate::ops::precision::round_to_bits;
use rayon::prelude::*;

/// Rows (and pairs' columns) of a tile; a tile row holds 32 bf16.
const TILE: usize = 16;
/// Elements of one packed operand tile: 16 rows of 32 bf16 (1 KiB).
const TILE_ELEMS: usize = 512;
/// The contraction covered by one operand tile.
const TILE_K: usize = 32;
/// Distance between a strip's consecutive tiles in a packed block: the block's other
/// strip's tile for the same `k` lies in between, so a step reads 2 KiB in a row.
const PITCH: usize = 2 * TILE_ELEMS;
/// Rows and columns of `c` one kernel call computes (2 × 2 accumulator tiles).
const BLOCK: usize = 32;
/// Column blocks of one parallel task (256 columns of `c`).
const TASK_COL_BLOCKS: usize = 8;
/// Row blocks of one parallel task (128 rows of `c`).
const TASK_ROW_BLOCKS: usize = 4;
/// Products below this many multiply-adds run on the calling thread.
const PAR_MIN_MACS: usize = 1 << 22;
/// `c` of at least this many bytes (beyond a core's L2), written whole (`β = 0`), is
/// stored past the caches.
const STREAM_MIN_BYTES: usize = 4 << 20;

/// One operand of a bf16 product as stored: f32 elements (rounded to bf16 as they are
/// packed) or bf16 bits (taken as they are).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Elems<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 bits.
    Bf16(&'a [u16]),
}

impl Elems<'_> {
    /// The bf16 bits of the element at `i`.
    #[inline(always)]
    fn bits(&self, i: usize) -> u16 {
        match self {
            Elems::F32(s) => narrow(s[i]),
            Elems::Bf16(s) => s[i],
        }
    }

    /// The bf16 bits of the `dst.len()` elements from `start` on, into `dst`.
    #[inline(always)]
    fn run_into(&self, start: usize, dst: &mut [u16]) {
        let len = dst.len();
        match self {
            Elems::F32(s) => {
                for (d, &x) in dst.iter_mut().zip(&s[start..start + len]) {
                    *d = narrow(x);
                }
            }
            Elems::Bf16(s) => dst.copy_from_slice(&s[start..start + len]),
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even; a NaN stays a quiet NaN): the emulation's
/// rounding (`round_to_bits`), its bits; a loop of it vectorises.
#[inline(always)]
fn narrow(x: f32) -> u16 {
    (round_to_bits(x, 16).to_bits() >> 16) as u16
}

/// Row and column strides of an operand, in elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    /// Distance between consecutive rows.
    pub row: usize,
    /// Distance between consecutive columns.
    pub col: usize,
}

/// Where and how a product's sums go, `c = beta·c + alpha·sums`: shared by the parallel
/// tasks, each writing its own elements only.
#[derive(Clone, Copy)]
struct Output {
    c: *mut f32,
    layout: Layout,
    alpha: f32,
    beta: f32,
}
// SAFETY: the tasks write disjoint blocks of `c` (see `product`).
unsafe impl Send for Output {}
// SAFETY: as above.
unsafe impl Sync for Output {}

thread_local! {
    /// The packed operands' buffers, kept between products (a training step packs the same
    /// sizes over and over; fresh allocations cost page faults).
    static BUFFERS: std::cell::RefCell<[Vec<u16>; 2]> = const {
        std::cell::RefCell::new([Vec::new(), Vec::new()])
    };
}

/// `c[n, m] = beta·c + alpha·(a[n, k] · b[k, m])` with both operands rounded to bf16, on AMX
/// tiles ([`available`] must be true), on the calling thread unless `parallel` (and the
/// product is large). `beta = 0` never reads `c`.
///
/// # Safety
/// [`available`] returned true; every element `(i, l)` of `a` (`i < n`, `l < k`) lies in
/// it at `i·sa.row + l·sa.col`, likewise `b` under `sb` and `c` under `sc`; the positions
/// of `c`'s elements are distinct and `c` overlaps neither operand.
#[allow(clippy::too_many_arguments)] // a GEMM's own argument list
pub(crate) unsafe fn product(
    n: usize,
    k: usize,
    m: usize,
    a: Elems<'_>,
    sa: Layout,
    b: Elems<'_>,
    sb: Layout,
    c: *mut f32,
    sc: Layout,
    alpha: f32,
    beta: f32,
    parallel: bool,
) {
    if n == 0 || m == 0 {
        return;
    }
    let k_tiles = k.div_ceil(TILE_K).max(1);
    let sizes = [
        2 * n.div_ceil(BLOCK) * k_tiles * TILE_ELEMS,
        2 * m.div_ceil(BLOCK) * k_tiles * TILE_ELEMS,
    ];
    let run = |bufs: &mut [Vec<u16>; 2]| {
        let [pa, pb] = bufs;
        let (pa, pb) = (at_64(pa, sizes[0]), at_64(pb, sizes[1]));
        // SAFETY: `available` (the caller's contract); the operands' layouts are theirs.
        let out = Output {
            c,
            layout: sc,
            alpha,
            beta,
        };
        unsafe { product_packed(n, k, m, a, sa, b, sb, out, parallel, pa, pb) }
    };
    // A rayon task of another product may run on this thread while it waits for its own
    // tasks: then its buffers are in use, and this product takes fresh ones.
    BUFFERS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => run(&mut bufs),
        Err(_) => run(&mut [Vec::new(), Vec::new()]),
    });
}

/// `len` elements of `buf` (grown if need be, keeping its contents) starting at a 64-byte
/// boundary: a tile row read from one cache line instead of two is several times faster.
fn at_64(buf: &mut Vec<u16>, len: usize) -> &mut [u16] {
    if buf.len() < len + 32 {
        buf.resize(len + 32, 0);
    }
    let skip = buf.as_ptr().align_offset(64).min(32);
    &mut buf[skip..skip + len]
}

/// Zeros where packed `a` (`[n, k]`, blocks of `block` elements) holds no element: the rows
/// past `n` in the last block and the columns past `k` in the last tile. The packers write
/// every element, so with these the buffer needs no clearing between products.
fn zero_a_padding(pa: &mut [u16], n: usize, k: usize, k_tiles: usize, block: usize) {
    let (rows, depth) = (n.div_ceil(BLOCK) * BLOCK, k_tiles * TILE_K);
    for i in 0..rows {
        let from = if i < n { k } else { 0 };
        for l in from..depth {
            pa[a_at(block, i, l)] = 0;
        }
    }
}

/// [`zero_a_padding`] for packed `b` (`[k, m]`): the columns past `m` in the last block
/// and the rows past `k` in the last tile.
fn zero_b_padding(pb: &mut [u16], k: usize, m: usize, k_tiles: usize, block: usize) {
    let (cols, depth) = (m.div_ceil(BLOCK) * BLOCK, k_tiles * TILE_K);
    for j in 0..cols {
        let from = if j < m { k } else { 0 };
        for l in from..depth {
            pb[b_at(block, l, j)] = 0;
        }
    }
}

/// [`product`] with the packing buffers at hand: `pa` and `pb` of the packed sizes, their
/// contents anything.
///
/// # Safety
/// As [`product`].
#[allow(clippy::too_many_arguments)]
unsafe fn product_packed(
    n: usize,
    k: usize,
    m: usize,
    a: Elems<'_>,
    sa: Layout,
    b: Elems<'_>,
    sb: Layout,
    output: Output,
    parallel: bool,
    pa: &mut [u16],
    pb: &mut [u16],
) {
    let Output {
        layout: sc, beta, ..
    } = output;
    let parallel = parallel && n.saturating_mul(k).saturating_mul(m) >= PAR_MIN_MACS;
    let (row_blocks, col_blocks) = (n.div_ceil(BLOCK), m.div_ceil(BLOCK));
    let k_tiles = k.div_ceil(TILE_K).max(1);
    // a block's two 16-row (or 16-column) strips of tiles, interleaved
    let block = 2 * k_tiles * TILE_ELEMS;
    let group = GROUP / BLOCK * block;
    zero_a_padding(pa, n, k, k_tiles, block);
    zero_b_padding(pb, k, m, k_tiles, block);
    // SAFETY (both): `available` implies AVX-512F and BW.
    let fill_a = |(g, dst): (usize, &mut [u16])| unsafe { pack_a(a, sa, n, k, block, g, dst) };
    let fill_b = |(g, dst): (usize, &mut [u16])| unsafe { pack_b(b, sb, k, m, block, g, dst) };
    if parallel {
        pa.par_chunks_mut(group).enumerate().for_each(fill_a);
        pb.par_chunks_mut(group).enumerate().for_each(fill_b);
    } else {
        pa.chunks_mut(group).enumerate().for_each(fill_a);
        pb.chunks_mut(group).enumerate().for_each(fill_b);
    }
    let (pa, pb) = (&*pa, &*pb);
    // a large `c` written whole goes past the caches: its lines are not read first, and
    // it does not evict the operands
    let stream =
        beta == 0.0 && sc.col == 1 && n.saturating_mul(m).saturating_mul(4) >= STREAM_MIN_BYTES;
    let task = |(rt, ct): (usize, usize)| {
        let cols = ct * PANEL..((ct + 1) * PANEL).min(m);
        // every element the write-out reads is stored by the tiles first
        let mut panel = std::mem::MaybeUninit::<Panel>::uninit();
        let sums = panel.as_mut_ptr().cast::<f32>();
        // SAFETY: `available`; released below, and no other tile code runs on this thread
        // in between (the task calls nothing that could run another product).
        unsafe { tile_config() };
        for rb in rt * TASK_ROW_BLOCKS..((rt + 1) * TASK_ROW_BLOCKS).min(row_blocks) {
            let a0 = &pa[rb * block..(rb + 1) * block];
            for cb in ct * TASK_COL_BLOCKS..((ct + 1) * TASK_COL_BLOCKS).min(col_blocks) {
                let b0 = &pb[cb * block..(cb + 1) * block];
                // SAFETY: `available`, configured; the packed blocks hold `k_tiles`
                // steps; the block's 32 columns of the panel are in it (`cb` is one of
                // the task's column blocks).
                unsafe {
                    let at = sums.add((cb - ct * TASK_COL_BLOCKS) * BLOCK);
                    tile_block(a0, b0, k_tiles, at, PANEL);
                }
            }
            let r0 = rb * BLOCK;
            // SAFETY: the panel's rows and columns were stored above; the task's rows
            // and columns of `c` are its alone (tasks own disjoint ranges of blocks) and
            // in bounds by the contract.
            unsafe { write_panel(sums, output, r0..(r0 + BLOCK).min(n), cols.clone(), stream) };
        }
        // SAFETY: `available`.
        unsafe { tile_release() };
        if stream {
            // the streamed stores are weakly ordered: visible before the task is done
            #[cfg(target_arch = "x86_64")]
            // SAFETY: SSE is part of x86-64.
            unsafe {
                std::arch::x86_64::_mm_sfence()
            };
        }
    };
    let (row_tasks, col_tasks) = (
        row_blocks.div_ceil(TASK_ROW_BLOCKS),
        col_blocks.div_ceil(TASK_COL_BLOCKS),
    );
    let tasks = (0..row_tasks).flat_map(|r| (0..col_tasks).map(move |c| (r, c)));
    if parallel {
        tasks.collect::<Vec<_>>().into_par_iter().for_each(task);
    } else {
        tasks.for_each(task);
    }
}

/// Columns of `c` one parallel task covers: its column blocks.
const PANEL: usize = TASK_COL_BLOCKS * BLOCK;

/// The sums of one row block of a task, row-major: 32 rows of [`PANEL`] f32 (32 KiB).
#[repr(C, align(64))]
struct Panel([f32; BLOCK * PANEL]);

/// `c[rows, cols] = beta·c + alpha·sums` (`beta = 0` never reads `c`), `sums` holding the
/// rows [`PANEL`] apart from the first of `cols`; with `stream`, the whole 64-byte lines of
/// a row-major `c` are written past the caches.
///
/// # Safety
/// As [`product`]'s for `c`; `sums` holds `rows.len()` rows of `cols.len()` sums; no other
/// thread touches these elements of `c`; `stream` only with a row-major `c`; the CPU has
/// AVX-512F where `c` is row-major.
unsafe fn write_panel(
    sums: *const f32,
    output: Output,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    stream: bool,
) {
    let Output {
        c,
        layout: sc,
        alpha,
        beta,
    } = output;
    // only the x86-64 path streams (the tiles exist nowhere else)
    #[cfg(not(target_arch = "x86_64"))]
    let _ = stream;
    #[cfg(target_arch = "x86_64")]
    if sc.col == 1 {
        // SAFETY: forwarded; `c`'s element (rows.start, cols.start) is in bounds.
        return unsafe {
            let at = c.add(rows.start * sc.row + cols.start);
            let (n, m) = (rows.len(), cols.len());
            simd::write_rows(sums, at, sc.row, n, m, alpha, beta, stream)
        };
    }
    for (r, i) in rows.enumerate() {
        for (l, j) in cols.clone().enumerate() {
            // SAFETY: the caller's: a stored sum, and element (i, j) of `c`.
            unsafe {
                let v = alpha * *sums.add(r * PANEL + l);
                let p = c.add(i * sc.row + j * sc.col);
                // `beta = 0` must not read `c` (it may hold garbage or NaN)
                *p = if beta == 0.0 { v } else { beta * *p + v };
            }
        }
    }
}

/// Rows of `a` (columns of `b`) one packing task covers: 8 blocks. A transposed operand is
/// read a whole row of the group at a time, so its reads stream instead of jumping a row
/// of memory for every 64 bytes.
const GROUP: usize = 8 * BLOCK;

/// Where element `(r, l)` of a group of `a` (row `r` of the group, `l < k`) lies in its
/// packed blocks of `block` elements each.
#[inline(always)]
fn a_at(block: usize, r: usize, l: usize) -> usize {
    (r / BLOCK) * block
        + (r / TILE % 2) * TILE_ELEMS
        + (l / TILE_K) * PITCH
        + (r % TILE) * TILE_K
        + l % TILE_K
}

/// Where element `(l, j)` of a group of `b` (`l < k`, column `j` of the group) lies in its
/// packed blocks of `block` elements each.
#[inline(always)]
fn b_at(block: usize, l: usize, j: usize) -> usize {
    (j / BLOCK) * block
        + (j / TILE % 2) * TILE_ELEMS
        + (l / TILE_K) * PITCH
        + (l % TILE_K / 2) * TILE_K
        + 2 * (j % TILE)
        + l % 2
}

/// The packers' AVX-512 cores for f32 operands: 16 lanes rounded to bf16 at once, pairs of
/// `k` built in registers and 16 × 16 blocks of pairs transposed in registers, a tile row
/// (64 bytes) stored at a time. Every function needs AVX-512F and BW.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{BLOCK, Elems, PANEL, PITCH, TILE, TILE_ELEMS, TILE_K};
    use std::arch::x86_64::*;

    /// `rows` rows of `cols` sums (rows [`PANEL`] apart in `sums`) into row-major `c`
    /// (rows `row` apart): `c = beta·c + alpha·sums` (`beta = 0` never reads `c`), 16 lanes at
    /// a time; with `stream` (and `beta = 0`), each row's whole 64-byte lines are written
    /// past the caches, its partial first and last lines as usual.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `sums` holds the sums; the `rows × cols` elements at `c` are
    /// writable and no one else's.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn write_rows(
        sums: *const f32,
        c: *mut f32,
        row: usize,
        rows: usize,
        cols: usize,
        alpha: f32,
        beta: f32,
        stream: bool,
    ) {
        let (scale, times) = (_mm512_set1_ps(beta), _mm512_set1_ps(alpha));
        let mask = |len: usize| ((1u32 << len.min(TILE)) - 1) as u16;
        // SAFETY (callers): the lanes under `k` are sums.
        let sums_at = |s: *const f32, k: u16| {
            let v = unsafe { _mm512_maskz_loadu_ps(k, s) };
            if alpha == 1.0 {
                v
            } else {
                _mm512_mul_ps(times, v)
            }
        };
        for r in 0..rows {
            // SAFETY (all): the caller's; the lanes under each mask are row `r`'s.
            let (src, dst) = unsafe { (sums.add(r * PANEL), c.add(r * row)) };
            let mut j = 0;
            if stream && beta == 0.0 {
                // up to the first line boundary, then whole lines, then the rest
                let head = (dst.align_offset(64)).min(cols);
                unsafe { _mm512_mask_storeu_ps(dst, mask(head), sums_at(src, mask(head))) };
                j = head;
                while j + TILE <= cols {
                    unsafe { _mm512_stream_ps(dst.add(j), sums_at(src.add(j), u16::MAX)) };
                    j += TILE;
                }
            }
            while j < cols {
                let k = mask(cols - j);
                unsafe {
                    let (s, d) = (src.add(j), dst.add(j));
                    let v = sums_at(s, k);
                    let v = if beta == 0.0 {
                        v
                    } else {
                        let old = _mm512_maskz_loadu_ps(k, d);
                        let old = if beta == 1.0 {
                            old
                        } else {
                            _mm512_mul_ps(scale, old)
                        };
                        _mm512_add_ps(old, v)
                    };
                    _mm512_mask_storeu_ps(d, k, v);
                }
                j += TILE;
            }
        }
    }

    /// `len ≤ 16` elements of `src` from `at` as f32 bits (the other lanes 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn load(src: &[f32], at: usize, len: usize) -> __m512i {
        if len == 0 {
            return _mm512_setzero_si512();
        }
        let s = &src[at..at + len]; // bounds checked once
        let mask = ((1u32 << len) - 1) as u16;
        // SAFETY: the masked lanes are the `len` elements of `s`.
        unsafe { _mm512_maskz_loadu_epi32(mask, s.as_ptr().cast()) }
    }

    /// `len ≤ 16` bf16 elements of `src` from `at` widened to f32 bits (the other lanes 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn load_bf16(src: &[u16], at: usize, len: usize) -> __m512i {
        if len == 0 {
            return _mm512_setzero_si512();
        }
        let s = &src[at..at + len]; // bounds checked once
        let mask = ((1u64 << len) - 1) as u32;
        // SAFETY: the masked lanes are the `len` elements of `s`.
        let v = unsafe { _mm512_maskz_loadu_epi16(mask, s.as_ptr().cast()) };
        _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)))
    }

    /// `len ≤ 16` elements of `src` from `at` as bf16 in the high halves of f32 bits:
    /// f32 elements rounded, bf16 ones as they are (the other lanes 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn lanes(src: Elems<'_>, at: usize, len: usize) -> __m512i {
        match src {
            Elems::F32(s) => round(load(s, at, len)),
            Elems::Bf16(s) => load_bf16(s, at, len),
        }
    }

    /// Each lane rounded to bf16 (the top 16 bits of the result; ties to even, NaN quiet),
    /// as `super::narrow`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn round(b: __m512i) -> __m512i {
        let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let up = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        let quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000));
        _mm512_mask_blend_epi32(nan, up, quiet)
    }

    /// Lane `i`: the bf16 pair `(even[i], odd[i])` of two rounded vectors, `even` low.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn pairs(even: __m512i, odd: __m512i) -> __m512i {
        let hi = _mm512_and_si512(odd, _mm512_set1_epi32(0xffff_0000u32 as i32));
        _mm512_or_si512(hi, _mm512_srli_epi32::<16>(even))
    }

    /// 16 × 16 32-bit lanes transposed: `r[i]` lane `j` ends in `r[j]` lane `i`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn transpose(r: &mut [__m512i; 16]) {
        let mut a = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        // b[4i + c], 128-bit lane L: rows 4i..4i+4 of column 4L + c
        let mut b = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
            b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
            b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
            b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
        }
        for c in 0..4 {
            let e0 = _mm512_shuffle_i32x4::<0x88>(b[c], b[4 + c]);
            let e1 = _mm512_shuffle_i32x4::<0xdd>(b[c], b[4 + c]);
            let f0 = _mm512_shuffle_i32x4::<0x88>(b[8 + c], b[12 + c]);
            let f1 = _mm512_shuffle_i32x4::<0xdd>(b[8 + c], b[12 + c]);
            r[c] = _mm512_shuffle_i32x4::<0x88>(e0, f0);
            r[4 + c] = _mm512_shuffle_i32x4::<0x88>(e1, f1);
            r[8 + c] = _mm512_shuffle_i32x4::<0xdd>(e0, f0);
            r[12 + c] = _mm512_shuffle_i32x4::<0xdd>(e1, f1);
        }
    }

    /// One tile row (32 bf16, 64 bytes) into `dst` at `at`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn store(dst: &mut [u16], at: usize, v: __m512i) {
        let d = &mut dst[at..at + TILE_K]; // bounds checked once
        // SAFETY: 64 writable bytes.
        unsafe { _mm512_storeu_si512(d.as_mut_ptr().cast(), v) };
    }

    /// The `min(32, len)` elements of `src` from `at` as one tile row of bf16 (zeros
    /// past `len`); `high` picks the high halves of 32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn tile_row(src: Elems<'_>, at: usize, len: usize, high: __m512i) -> __m512i {
        let lo = lanes(src, at, TILE.min(len));
        let hi = lanes(src, at + TILE, TILE.min(len.saturating_sub(TILE)));
        _mm512_permutex2var_epi16(lo, high, hi)
    }

    /// The lane indices that [`tile_row`] takes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn high_halves() -> __m512i {
        // the high halves of 32 rounded lanes: bf16 l0 + i at u16 position i
        let high: [i16; 32] = std::array::from_fn(|i| (2 * i + 1) as i16);
        // SAFETY: 64 readable bytes.
        unsafe { _mm512_loadu_si512(high.as_ptr().cast()) }
    }

    /// `a` `[n, k]` stored row-major (`a[i, l]` at `src[i·row + l]`): the group's `rows`
    /// rows from `i0` on into its packed blocks (of `block` elements), a tile row at a
    /// time.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pack_a_rows(
        src: Elems<'_>,
        row: usize,
        i0: usize,
        rows: usize,
        k: usize,
        block: usize,
        dst: &mut [u16],
    ) {
        let high = high_halves();
        for r in 0..rows {
            for l0 in (0..k).step_by(TILE_K) {
                let v = tile_row(src, (i0 + r) * row + l0, k - l0, high);
                store(dst, super::a_at(block, r, l0), v);
            }
        }
    }

    /// `a` `[n, k]` stored with its columns contiguous (`a[i, l]` at `src[l·col + i]`):
    /// the group's `rows` rows from `i0` on into its packed blocks (of `block` elements).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pack_a_t(
        src: Elems<'_>,
        col: usize,
        i0: usize,
        rows: usize,
        k: usize,
        block: usize,
        dst: &mut [u16],
    ) {
        let mut r = [_mm512_setzero_si512(); 16];
        // 32 rows of the source at a time, each read along the group (1 KiB in a row)
        // rather than a strip's 64 bytes down all `k` rows (a cache miss each)
        for l0 in (0..k).step_by(TILE_K) {
            for s in 0..rows.div_ceil(TILE) {
                let len = TILE.min(rows - s * TILE);
                let strip = (s * TILE / BLOCK) * block + (s % 2) * TILE_ELEMS;
                // r[p]: pair p of k for the strip's 16 rows, then each row's 16 pairs
                for (p, rp) in r.iter_mut().enumerate() {
                    let l = l0 + 2 * p;
                    let at = |l: usize| l * col + i0 + s * TILE;
                    let even = if l < k {
                        lanes(src, at(l), len)
                    } else {
                        _mm512_setzero_si512()
                    };
                    let odd = if l + 1 < k {
                        lanes(src, at(l + 1), len)
                    } else {
                        _mm512_setzero_si512()
                    };
                    *rp = pairs(even, odd);
                }
                transpose(&mut r);
                let tile = strip + (l0 / TILE_K) * PITCH;
                for (i, &v) in r.iter().enumerate().take(len) {
                    store(dst, tile + i * TILE_K, v);
                }
            }
        }
    }

    /// `b` `[k, m]` stored row-major (`b[l, j]` at `src[l·row + j]`): the group's `cols`
    /// columns from `j0` on into its packed blocks (of `block` elements).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pack_b_rows(
        src: Elems<'_>,
        row: usize,
        j0: usize,
        cols: usize,
        k: usize,
        block: usize,
        dst: &mut [u16],
    ) {
        // a pair of rows of the source at a time, each read along the group
        for l in (0..k).step_by(2) {
            for s in 0..cols.div_ceil(TILE) {
                let len = TILE.min(cols - s * TILE);
                let strip = (s * TILE / BLOCK) * block + (s % 2) * TILE_ELEMS;
                let at = |l: usize| l * row + j0 + s * TILE;
                let even = lanes(src, at(l), len);
                let odd = if l + 1 < k {
                    lanes(src, at(l + 1), len)
                } else {
                    _mm512_setzero_si512()
                };
                let tile_row = strip + (l / TILE_K) * PITCH + (l % TILE_K / 2) * TILE_K;
                store(dst, tile_row, pairs(even, odd));
            }
        }
    }

    /// `b` `[k, m]` stored with its columns contiguous (`b[l, j]` at `src[j·col + l]`, a
    /// weight `[m, k]` read transposed): the group's `cols` columns from `j0` on into its
    /// packed blocks (of `block` elements).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pack_b_t(
        src: Elems<'_>,
        col: usize,
        j0: usize,
        cols: usize,
        k: usize,
        block: usize,
        dst: &mut [u16],
    ) {
        let high = high_halves();
        let mut r = [_mm512_setzero_si512(); 16];
        for s in 0..cols.div_ceil(TILE) {
            let len = TILE.min(cols - s * TILE);
            let strip = (s * TILE / BLOCK) * block + (s % 2) * TILE_ELEMS;
            for l0 in (0..k).step_by(TILE_K) {
                // r[j]: column j's 16 pairs of this tile, then each pair's 16 columns
                for (j, rj) in r.iter_mut().enumerate() {
                    if j >= len {
                        *rj = _mm512_setzero_si512();
                        continue;
                    }
                    let at = (j0 + s * TILE + j) * col + l0;
                    *rj = tile_row(src, at, k - l0, high);
                }
                transpose(&mut r);
                let tile = strip + (l0 / TILE_K) * PITCH;
                for (p, &v) in r.iter().enumerate() {
                    store(dst, tile + p * TILE_K, v);
                }
            }
        }
    }
}

/// Group `g` of `a` `[n, k]` (rows `256·g..`) rounded into its packed blocks in `dst`
/// (the blocks of `block` elements each; every element written, the padding left as it
/// is), compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F and BW.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bw"))]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_a(
    a: Elems<'_>,
    s: Layout,
    n: usize,
    k: usize,
    block: usize,
    g: usize,
    dst: &mut [u16],
) {
    let i0 = g * GROUP;
    let rows = GROUP.min(n - i0);
    #[cfg(target_arch = "x86_64")]
    match (s.col, s.row) {
        (1, _) => return simd::pack_a_rows(a, s.row, i0, rows, k, block, dst),
        (_, 1) => return simd::pack_a_t(a, s.col, i0, rows, k, block, dst),
        _ => {}
    }
    if s.col == 1 {
        // rows contiguous in `a`: 32 elements at a time, straight into their tile rows
        for r in 0..rows {
            for l0 in (0..k).step_by(TILE_K) {
                let at = a_at(block, r, l0);
                let len = TILE_K.min(k - l0);
                a.run_into((i0 + r) * s.row + l0, &mut dst[at..at + len]);
            }
        }
    } else {
        pack_scalar(a, s.row, s.col, i0, rows, k, dst, |r, l| a_at(block, r, l));
    }
}

/// Group `g` of `b` `[k, m]` (columns `256·g..`) rounded into its packed blocks in `dst`
/// (the blocks of `block` elements each; every element written, the padding left as it
/// is), compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F and BW.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bw"))]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_b(
    b: Elems<'_>,
    s: Layout,
    k: usize,
    m: usize,
    block: usize,
    g: usize,
    dst: &mut [u16],
) {
    let j0 = g * GROUP;
    let cols = GROUP.min(m - j0);
    #[cfg(target_arch = "x86_64")]
    match (s.col, s.row) {
        (1, _) => return simd::pack_b_rows(b, s.row, j0, cols, k, block, dst),
        (_, 1) => return simd::pack_b_t(b, s.col, j0, cols, k, block, dst),
        _ => {}
    }
    pack_scalar(b, s.col, s.row, j0, cols, k, dst, |j, l| b_at(block, l, j));
}

/// One group of an operand packed element by element (bf16 operands, odd layouts): its
/// element `(o, l)` — `o` the group's row of `a` or column of `b`, `l < k` — read at
/// `(o0 + o)·so + l·sl` and stored at `at(o, l)`, the loops walking the source in its
/// contiguous direction.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pack_scalar(
    e: Elems<'_>,
    so: usize,
    sl: usize,
    o0: usize,
    outer: usize,
    k: usize,
    dst: &mut [u16],
    at: impl Fn(usize, usize) -> usize,
) {
    if sl == 1 {
        // contiguous along k: 32 elements at a time
        let mut run = [0u16; TILE_K];
        for o in 0..outer {
            for l0 in (0..k).step_by(TILE_K) {
                let len = TILE_K.min(k - l0);
                e.run_into((o0 + o) * so + l0, &mut run[..len]);
                for (l, &v) in run[..len].iter().enumerate() {
                    dst[at(o, l0 + l)] = v;
                }
            }
        }
    } else if so == 1 {
        // contiguous along the group: its part of a row of the source at a time
        let mut run = [0u16; GROUP];
        for l in 0..k {
            e.run_into(l * sl + o0, &mut run[..outer]);
            for (o, &v) in run[..outer].iter().enumerate() {
                dst[at(o, l)] = v;
            }
        }
    } else {
        for o in 0..outer {
            for l in 0..k {
                dst[at(o, l)] = e.bits((o0 + o) * so + l * sl);
            }
        }
    }
}

/// The tile configuration: palette 1, tiles 0–7 each 16 rows of 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

#[cfg(target_arch = "x86_64")]
const CONFIG: TileConfig = {
    let mut cfg = [0u8; 64];
    cfg[0] = 1; // palette 1
    let mut t = 0;
    while t < 8 {
        cfg[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
        cfg[48 + t] = TILE as u8; // rows
        t += 1;
    }
    TileConfig(cfg)
};

/// Loads [`CONFIG`] into the tile unit (which also zeroes the tiles).
///
/// # Safety
/// [`available`].
#[cfg(target_arch = "x86_64")]
unsafe fn tile_config() {
    // SAFETY: `available`: the tile state is the process's; CONFIG is 64 readable bytes.
    unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack)) };
}

/// Returns the tile unit to its initial state (cheaper for the OS to switch).
///
/// # Safety
/// [`available`].
#[cfg(target_arch = "x86_64")]
unsafe fn tile_release() {
    // SAFETY: `available`.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_config() {}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_release() {}

/// The 32 × 32 block at `c` (rows `c_row` elements apart) `=` `a`'s two row strips times
/// `b`'s two column strips, over `k_tiles` tiles: tiles 0–3 accumulate (rows
/// `16·(t / 2)..`, columns `16·(t % 2)..`), 4–5 hold `a`'s tiles, 6–7 `b`'s.
///
/// # Safety
/// [`available`] and [`tile_config`] run on this thread since the last [`tile_release`];
/// `c` addresses 32 rows of 32 writable f32, `c_row` apart, that nothing else accesses.
#[cfg(target_arch = "x86_64")]
unsafe fn tile_block(a: &[u16], b: &[u16], k_tiles: usize, c: *mut f32, c_row: usize) {
    assert!(k_tiles >= 1 && a.len() >= 2 * k_tiles * TILE_ELEMS);
    assert!(b.len() >= 2 * k_tiles * TILE_ELEMS);
    let c_low = c.wrapping_add(TILE * c_row); // rows 16..32
    // SAFETY: the caller's contract: the tiles' reads stay in `a` and `b` (`k_tiles`
    // steps of two tiles each, checked above), the stores in `c`'s block (tiles at its
    // rows 0 and 16, columns 0 and 16: byte offset 64).
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a} + {stride}*1]",
            "tileloadd tmm6, [{b} + {stride}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {stride}*1 + 1024]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a} + {stride}*1 + 1024]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a}, 2048",
            "add {b}, 2048",
            "dec {n}",
            "jnz 2b",
            "tilestored [{c} + {cs}*1], tmm0",
            "tilestored [{c} + {cs}*1 + 64], tmm1",
            "tilestored [{c2} + {cs}*1], tmm2",
            "tilestored [{c2} + {cs}*1 + 64], tmm3",
            a = inout(reg) a.as_ptr() => _,
            b = inout(reg) b.as_ptr() => _,
            c = in(reg) c,
            c2 = in(reg) c_low,
            cs = in(reg) c_row * 4,
            n = inout(reg) k_tiles => _,
            stride = in(reg) 64usize,
            out("tmm0") _,
            out("tmm1") _,
            out("tmm2") _,
            out("tmm3") _,
            out("tmm4") _,
            out("tmm5") _,
            out("tmm6") _,
            out("tmm7") _,
            options(nostack),
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_block(_: &[u16], _: &[u16], _: usize, _: *mut f32, _: usize) {
    unreachable!("AMX is never available off x86-64")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::precision::MatmulPrecision::Bf16;
    use crate::ops::stored::{Bf16Bits, Widen};

    /// A deterministic pseudo-random value in [-2, 2).
    fn value(seed: u64, i: usize) -> f32 {
        let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }

    /// `c = beta·c + a·b` through `product` with `a` row-major or transposed in memory and
    /// `b` likewise, against the f64 sums of the bf16-rounded operands.
    fn check(n: usize, k: usize, m: usize, a_t: bool, b_t: bool, beta: f32) {
        let plain = Stored {
            bf16: false,
            c_off: 0,
            alpha: 1.0,
            parallel: true,
        };
        check_stored(n, k, m, a_t, b_t, beta, plain);
    }

    /// What [`check_stored`] varies: the operands as bf16 bits, `c`'s offset in its buffer
    /// (its rows then start off the 64-byte lines), `alpha`, and threads allowed.
    #[derive(Clone, Copy)]
    struct Stored {
        bf16: bool,
        c_off: usize,
        alpha: f32,
        parallel: bool,
    }

    /// [`check`] with the variations of `how`.
    fn check_stored(n: usize, k: usize, m: usize, a_t: bool, b_t: bool, beta: f32, how: Stored) {
        let Stored {
            bf16,
            c_off,
            alpha,
            parallel,
        } = how;
        let a: Vec<f32> = (0..n * k).map(|i| value(1, i)).collect();
        let b: Vec<f32> = (0..k * m).map(|i| value(2, i)).collect();
        let (a16, b16): (Vec<u16>, Vec<u16>) = (
            a.iter().map(|&x| narrow(x)).collect(),
            b.iter().map(|&x| narrow(x)).collect(),
        );
        let (ea, eb) = match bf16 {
            false => (Elems::F32(&a), Elems::F32(&b)),
            true => (Elems::Bf16(&a16), Elems::Bf16(&b16)),
        };
        let sa = match a_t {
            false => Layout { row: k, col: 1 },
            true => Layout { row: 1, col: n },
        };
        let sb = match b_t {
            false => Layout { row: m, col: 1 },
            true => Layout { row: 1, col: k },
        };
        let c0: Vec<f32> = (0..n * m).map(|i| value(3, i)).collect();
        let mut buf = vec![0.0; c_off + n * m];
        buf[c_off..].copy_from_slice(&c0);
        // SAFETY: the test runs only where `available`; row-major `c`, operands in bounds.
        unsafe {
            let c = buf[c_off..].as_mut_ptr();
            let sc = Layout { row: m, col: 1 };
            product(n, k, m, ea, sa, eb, sb, c, sc, alpha, beta, parallel);
        }
        let c = &buf[c_off..];
        for i in 0..n {
            for j in 0..m {
                let (mut sum, mut abs) = (0f64, 0f64);
                for l in 0..k {
                    let x = f64::from(Bf16.round(a[i * sa.row + l * sa.col]));
                    let y = f64::from(Bf16.round(b[l * sb.row + j * sb.col]));
                    sum += x * y;
                    abs += (x * y).abs();
                }
                let (alpha, beta) = (f64::from(alpha), f64::from(beta));
                let want = beta * f64::from(c0[i * m + j]) + alpha * sum;
                let got = f64::from(c[i * m + j]);
                // f32 sums of k products: each addition rounds by at most 2⁻²⁴ of the
                // running sum's magnitude, bounded by Σ|products| (+ the scaling and the
                // beta·c term: a rounding each)
                let tol = (k as f64 + 3.0)
                    * 2f64.powi(-24)
                    * (alpha.abs() * abs + f64::from(c0[i * m + j]).abs());
                assert!(
                    (got - want).abs() <= tol,
                    "{n}×{k}×{m} (a_t {a_t}, b_t {b_t}, alpha {alpha}, beta {beta}, bf16 {bf16}, \
                     c_off {c_off}, parallel {parallel}) at ({i}, {j}): {got} vs {want}"
                );
            }
        }
    }

    /// The tiles round each f32 addition to nearest, ties to even, in `k` order (never
    /// toward zero: a bias that every sum of a training step would share): 1 plus a product
    /// of 0.75 ulp rounds up, of an exact half ulp stays at the even 1, minus 1.5 ulps below
    /// 1 (a tie there) goes to the even neighbour; three quarter-ulps added one at a time
    /// each round away.
    #[test]
    fn tile_sums_round_to_nearest_even_in_k_order() {
        if !crate::isa::amx_available() {
            eprintln!("no AMX on this CPU (or not granted): nothing to check");
            return;
        }
        let dot = |a: &[f32], b: &[f32]| -> f32 {
            let k = a.len();
            let mut c = [f32::NAN];
            let (sa, sb, sc) = (
                Layout { row: k, col: 1 },
                Layout { row: 1, col: 1 },
                Layout { row: 1, col: 1 },
            );
            // SAFETY: AMX is available; `a` is [1, k], `b` [k, 1], `c` one element.
            unsafe {
                product(
                    1,
                    k,
                    1,
                    Elems::F32(a),
                    sa,
                    Elems::F32(b),
                    sb,
                    c.as_mut_ptr(),
                    sc,
                    1.0,
                    0.0,
                    false,
                )
            };
            c[0]
        };
        let (ulp, p) = (f32::EPSILON, 2f32.powi(-12));
        // 1·1 plus a second product of 0.75 ulp (both bf16-exact)
        assert_eq!(dot(&[1.0, 1.5 * p], &[1.0, p]), 1.0 + ulp);
        assert_eq!(dot(&[1.5 * p, 1.0], &[p, 1.0]), 1.0 + ulp, "either order");
        assert_eq!(
            dot(&[1.0, -1.5 * p], &[1.0, p]),
            1.0 - ulp,
            "a tie below 1, to even"
        );
        assert_eq!(
            dot(&[1.0, p], &[1.0, p]),
            1.0,
            "a tie goes to the even neighbour"
        );
        let mut a = vec![0.0f32; 33];
        let mut b = a.clone();
        (a[0], b[0], a[32], b[32]) = (1.0, 1.0, 1.5 * p, p);
        assert_eq!(dot(&a, &b), 1.0 + ulp, "across tiles of k");
        // 0.25 ulp three times, each addition rounded: 1 (the exact sum would round up)
        let q = 2f32.powi(-13);
        assert_eq!(dot(&[1.0, q, q, q], &[1.0, p, p, p]), 1.0);
    }

    #[test]
    fn products_equal_the_rounded_operands_sums() {
        if !crate::isa::amx_available() {
            eprintln!("no AMX on this CPU (or not granted): nothing to check");
            return;
        }
        for (n, k, m) in [
            (1, 1, 1),
            (16, 32, 16),
            (17, 33, 15),
            (32, 64, 32),
            (64, 7, 100),
            (100, 257, 129),
            (3, 600, 2),
        ] {
            for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
                for beta in [0.0, 1.0, 0.5] {
                    check(n, k, m, a_t, b_t, beta);
                    let how = Stored {
                        bf16: true,
                        c_off: 1,
                        alpha: 0.125,
                        parallel: false,
                    };
                    check_stored(n, k, m, a_t, b_t, beta, how);
                }
            }
        }
        // the parallel tasks (past PAR_MIN_MACS)
        check(300, 256, 300, false, true, 1.0);
        check(257, 128, 513, true, false, 0.0);
        // a `c` of 4 MiB or more, written whole: streamed, from a row start on a line
        // boundary and off it (its first and last lines partial)
        for (c_off, alpha) in [(0, 1.0), (3, -0.5)] {
            let how = Stored {
                bf16: false,
                c_off,
                alpha,
                parallel: true,
            };
            check_stored(1030, 40, 1027, false, true, 0.0, how);
        }
    }

    /// Small integers: every product and partial sum is exact in f32, so any order of the
    /// sums gives the emulation's bits; bf16 bits as stored equal f32 elements rounded.
    #[test]
    fn exact_sums_give_the_emulations_bits() {
        if !crate::isa::amx_available() {
            eprintln!("no AMX on this CPU (or not granted): nothing to check");
            return;
        }
        let (n, k, m) = (70, 90, 50);
        let a: Vec<f32> = (0..n * k).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
        let b: Vec<f32> = (0..k * m).map(|i| ((i * 5) % 11) as f32 - 5.0).collect();
        let b16: Vec<u16> = b.iter().map(|&x| Bf16Bits::narrow(x)).collect();
        let mut want = vec![0f32; n * m];
        for i in 0..n {
            for j in 0..m {
                want[i * m + j] = (0..k).map(|l| a[i * k + l] * b[l * m + j]).sum();
            }
        }
        // `b` also stored transposed (`bt[j, l]`: a weight `[m, k]` as the forward reads it)
        let bt: Vec<f32> = (0..m * k).map(|i| b[(i % k) * m + i / k]).collect();
        let bt16: Vec<u16> = bt.iter().map(|&x| Bf16Bits::narrow(x)).collect();
        let (rows, cols) = (Layout { row: m, col: 1 }, Layout { row: 1, col: k });
        for (b, sb) in [
            (Elems::F32(&b), rows),
            (Elems::Bf16(&b16), rows),
            (Elems::F32(&bt), cols),
            (Elems::Bf16(&bt16), cols),
        ] {
            let mut c = vec![f32::NAN; n * m]; // beta = 0 never reads it
            // SAFETY: as in `check`.
            unsafe {
                product(
                    n,
                    k,
                    m,
                    Elems::F32(&a),
                    Layout { row: k, col: 1 },
                    b,
                    sb,
                    c.as_mut_ptr(),
                    Layout { row: m, col: 1 },
                    1.0,
                    0.0,
                    true,
                );
            }
            assert_eq!(c, want, "{sb:?}");
        }
    }

    /// The vector rounding is `Bf16Bits::narrow`'s, on the values where rounding is subtle.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn packed_bits_are_the_rounded_elements() {
        if !crate::isa::amx_available() {
            eprintln!("no AMX on this CPU (or not granted): nothing to check");
            return;
        }
        let special = [
            0.0,
            -0.0,
            1.0 + 2f32.powi(-8),       // a tie: to even (1)
            1.0 + 3.0 * 2f32.powi(-8), // a tie: to even (up)
            1.0 + 2f32.powi(-8) + 2f32.powi(-20),
            f32::MAX, // rounds to ∞
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN: made quiet
            f32::from_bits(0x0000_8001), // subnormal
            f32::MIN_POSITIVE,
            -1.0e-30,
            3.0e38,
        ];
        let src: Vec<f32> = (0..2 * 16)
            .map(|i| special[i % 16] * if i >= 16 { -1.0 } else { 1.0 })
            .collect();
        let mut dst = vec![0u16; 2 * TILE_ELEMS];
        // SAFETY: `available`.
        unsafe { simd::pack_b_rows(Elems::F32(&src), 16, 0, 16, 2, 2 * TILE_ELEMS, &mut dst) };
        for l in 0..2 {
            for j in 0..16 {
                let want = Bf16Bits::narrow(src[l * 16 + j]);
                assert_eq!(dst[b_at(2 * TILE_ELEMS, l, j)], want, "{}", src[l * 16 + j]);
                assert_eq!(narrow(src[l * 16 + j]), want);
            }
        }
    }

    /// What the module states of subnormals: an operand below bf16's normal range counts
    /// as 0, and so does a subnormal result (the emulation keeps both).
    #[test]
    fn subnormals_flush_to_zero() {
        if !crate::isa::amx_available() {
            eprintln!("no AMX on this CPU (or not granted): nothing to check");
            return;
        }
        let sub = f32::from_bits(0x0001_0000); // a bf16 subnormal, 9.2e-41
        let run = |a: f32, b: f32| {
            let mut c = [f32::NAN];
            let one = Layout { row: 1, col: 1 };
            // SAFETY: `available`; 1 × 1 × 1, every operand one element.
            unsafe {
                product(
                    1,
                    1,
                    1,
                    Elems::F32(&[a]),
                    one,
                    Elems::F32(&[b]),
                    one,
                    c.as_mut_ptr(),
                    one,
                    1.0,
                    0.0,
                    true,
                )
            };
            c[0]
        };
        assert_eq!(run(sub, 2f32.powi(100)), 0.0); // exact: 1.16e-10
        assert_eq!(run(1e-20, 1e-20), 0.0); // about 1e-40
        // a normal result stays: bf16(1e-18)² ≈ 1e-36
        let normal = run(1e-18, 1e-18);
        assert!((normal / 1e-36 - 1.0).abs() < 0.01, "{normal:e}");
    }

    /// Each element of `c` is one tile product's: the same bits on 1 thread as on 3.
    #[test]
    fn bits_do_not_depend_on_the_thread_count() {
        if !crate::isa::amx_available() {
            eprintln!("no AMX on this CPU (or not granted): nothing to check");
            return;
        }
        let (n, k, m) = (200, 300, 260);
        let a: Vec<f32> = (0..n * k).map(|i| value(4, i)).collect();
        let b: Vec<f32> = (0..k * m).map(|i| value(5, i)).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut c = vec![0f32; n * m];
            pool.install(|| {
                // SAFETY: as in `check`.
                unsafe {
                    product(
                        n,
                        k,
                        m,
                        Elems::F32(&a),
                        Layout { row: k, col: 1 },
                        Elems::F32(&b),
                        Layout { row: 1, col: k },
                        c.as_mut_ptr(),
                        Layout { row: m, col: 1 },
                        1.0,
                        0.0,
                        true,
                    );
                }
            });
            c
        };
        let one = run(1);
        assert_eq!(
            one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            run(3).iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}
