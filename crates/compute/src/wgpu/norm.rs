//! Row norms (RMS and layer norm) on the GPU, with the int8 blocks of a decode norm's result
//! written in the same kernel.
//!
//! Three kernels: `norm_split.wgsl` takes a decode row's RMS norm (one row of whole 32-value
//! blocks) with a workgroup per block, each summing the whole row; `norm_reg.wgsl` keeps a row in
//! one workgroup's registers (each invocation `nv` vec4 of it) and reduces through subgroups, for
//! several rows and layer norms; `norm.wgsl` (a loop over the row per invocation, a tree
//! reduction through workgroup memory) takes the rows `norm_reg` cannot: widths that are not
//! whole vec4, or wider than its largest workgroup holds.
//!
//! Why: the decode norm of an 8B model (one row of 4096) took 23 us on the H200 with
//! `norm.wgsl`, where a dependent dispatch costs 3; it is two per layer. `norm_reg` is one
//! round trip to memory for the inputs and one for the outputs, but on one SM: leaving both
//! norms out made the 8B decode 18% faster (tenth session), so a norm still cost ~9 us there.
//! `norm_split` spreads it over the GPU: 8B decode +9% (Q4_0) and +3% (Q4_K) over `norm_reg`
//! (same lease, three alternating rounds). Deferring the norm into the product before it instead
//! (the AddNorm attempt in docs/NOTES.md) cost as much as it saved.
//!
//! `DISKFORMER_NORM=old` keeps `norm.wgsl` for every width, `DISKFORMER_NORM=<wg>` (a power of
//! two) sets `norm_reg`'s workgroup size, `DISKFORMER_NORM_SPLIT=0` keeps `norm_reg` for decode
//! rows, for comparisons on the device.

use super::shaders::{Plain, NORM_IO_VEC4, NORM_PARAMS, SG_ARGS, SG_CALL};
use super::{OpError, Q8Act, WgpuBackend, WgpuTensor};

/// Largest `nv` (vec4 per invocation) the automatic choice takes before widening the workgroup.
const NV_MAX: u32 = 8;
/// Largest `nv` an explicit workgroup size may need.
const NV_MAX_FORCED: u32 = 16;

/// Workgroup size and vec4 per invocation of `norm_reg.wgsl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NormShape {
    /// Invocations per workgroup (a power of two, 32 or more).
    pub(super) wg: u32,
    /// vec4 of the row per invocation.
    pub(super) nv: u32,
}

/// Which kernel a width takes, by `DISKFORMER_NORM` (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NormChoice {
    /// `norm_reg` with the workgroup size [`NormShape::for_width`] picks.
    Auto,
    /// `norm.wgsl` always.
    Old,
    /// `norm_reg` with this workgroup size.
    Wg(u32),
}

impl NormChoice {
    pub(super) fn from_env() -> NormChoice {
        match std::env::var("DISKFORMER_NORM").ok().as_deref() {
            Some("old") => NormChoice::Old,
            Some(v) => match v.parse::<u32>() {
                Ok(wg) if wg.is_power_of_two() && wg >= 32 => NormChoice::Wg(wg),
                _ => NormChoice::Auto,
            },
            None => NormChoice::Auto,
        }
    }
}

impl NormShape {
    /// The shape for rows of `width` values, `None` when `norm_reg` does not take them (not
    /// whole vec4, wider than `max_wg` invocations hold, or `choice` says `norm.wgsl`).
    ///
    /// The workgroup is the smallest power of two (32 to 256) that covers the row with one vec4
    /// per invocation, widened past 256 only when a row needs more than [`NV_MAX`] vec4 per
    /// invocation: a 4096-wide row is 256 x 4 (a latency-bound kernel, where each invocation's
    /// four loads are in flight together and the cross-subgroup step stays short).
    pub(super) fn for_width(width: usize, max_wg: u32, choice: NormChoice) -> Option<NormShape> {
        if width == 0 || !width.is_multiple_of(4) {
            return None;
        }
        let nv4 = u32::try_from(width / 4).ok()?;
        let shape = |wg: u32| NormShape { wg, nv: nv4.div_ceil(wg) };
        match choice {
            NormChoice::Old => None,
            NormChoice::Wg(wg) => Some(shape(wg)).filter(|s| s.wg <= max_wg && s.nv <= NV_MAX_FORCED),
            NormChoice::Auto => {
                let mut s = shape(nv4.next_power_of_two().clamp(32, 256));
                while s.nv > NV_MAX && s.wg * 2 <= max_wg {
                    s = shape(s.wg * 2);
                }
                Some(s).filter(|s| s.nv <= NV_MAX && s.wg <= max_wg)
            }
        }
    }

    /// The pipeline cache key.
    pub(super) fn key(self, subgroups: bool) -> String {
        format!("norm_reg {}x{} sg{subgroups}", self.wg, self.nv)
    }

    /// `norm_reg.wgsl` for this shape, with subgroup reductions and shuffles when `subgroups`.
    pub(super) fn source(self, subgroups: bool) -> String {
        let (reduce, sg_args, sg_call, lanes, position, shuffle_max, shuffle_sum) = if subgroups {
            (
                REDUCE_SUBGROUP,
                "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,\n    @builtin(subgroup_size) sg_size: u32,",
                SG_CALL,
                "if (lid == 0u) {\n        lanes_ok = select(0u, 1u, n_sg * sg_size == WG && sg_size >= 8u);\n    }",
                "if (shuffles) {\n        p = sg_id * sg_size + sg_lane;\n    }",
                "amax = max(amax, subgroupShuffleXor(amax, 1u));\n                amax = max(amax, subgroupShuffleXor(amax, 2u));\n                amax = max(amax, subgroupShuffleXor(amax, 4u));",
                "qsum += subgroupShuffleXor(qsum, 1u);\n                qsum += subgroupShuffleXor(qsum, 2u);\n                qsum += subgroupShuffleXor(qsum, 4u);",
            )
        } else {
            (REDUCE_SHARED, "", "", "if (lid == 0u) {\n        lanes_ok = 0u;\n    }", "", "", "")
        };
        include_str!("shaders/norm_reg.wgsl")
            .replace("{{NORM_PARAMS}}", NORM_PARAMS)
            .replace("{{NORM_IO_VEC4}}", NORM_IO_VEC4)
            .replace("{{WG}}", &self.wg.to_string())
            .replace("{{NV}}", &self.nv.to_string())
            .replace("{{RED_LEN}}", &(2 * self.wg).to_string())
            .replace("{{REDUCE}}", reduce)
            .replace("{{SG_ARGS}}", sg_args)
            .replace("{{SG_CALL}}", sg_call)
            .replace("{{LANES}}", lanes)
            .replace("{{POSITION}}", position)
            .replace("{{SHUFFLE_MAX}}", shuffle_max)
            .replace("{{SHUFFLE_SUM}}", shuffle_sum)
    }
}

impl NormShape {
    /// The pipeline cache key of [`NormShape::pair_source`].
    pub(super) fn pair_key(self, subgroups: bool) -> String {
        format!("norm_reg pair {}x{} sg{subgroups}", self.wg, self.nv)
    }

    /// `norm_reg.wgsl` over the rows of two tensors, each with its own weight and output (X2, W2,
    /// Y2 bound after the int8 outputs; `rows_a`, the first tensor's rows, in the parameters'
    /// spare word): the per-head q and k norms of a decode step in one dispatch instead of two
    /// (two dependent dispatches cost ~7 us a layer on the H200, twenty-first session).
    pub(super) fn pair_source(self, subgroups: bool) -> String {
        let edits = [
            ("_p1: u32,", "rows_a: u32,"),
            (
                "@group(0) @binding(6) var<uniform> P: Params;",
                "@group(0) @binding(6) var<storage, read> X2: array<vec4<f32>>;\n@group(0) @binding(7) var<storage, read> W2: array<vec4<f32>>;\n@group(0) @binding(8) var<storage, read_write> Y2: array<vec4<f32>>;\n@group(0) @binding(9) var<uniform> P: Params;",
            ),
            // Rows from rows_a on are the second tensor's (uniform per workgroup).
            ("let base = row * nv4;", "let second = row >= P.rows_a;\n    let base = select(row, row - P.rows_a, second) * nv4;"),
            ("v[j] = X[base + i];", "v[j] = select(X[base + i], X2[base + i], second);"),
            ("wv[j] = Wt[i];", "wv[j] = select(Wt[i], W2[i], second);"),
            ("Y[base + i] = y;", "if (second) {\n                Y2[base + i] = y;\n            } else {\n                Y[base + i] = y;\n            }"),
        ];
        let mut src = self.source(subgroups);
        for (from, to) in edits {
            assert!(src.contains(from), "norm_reg.wgsl no longer has `{from}` for its pair variant");
            src = src.replacen(from, to, 1);
        }
        src
    }
}

/// `norm_split.wgsl`'s workgroup size for rows of `width` values: one vec4 per invocation up to
/// 256 (a 4096-wide row: 4 per invocation), at least 32.
fn split_workgroup(width: usize) -> u32 {
    ((width / 4).next_power_of_two() as u32).clamp(32, 256)
}

/// `norm_split.wgsl` with `wg` invocations, its row sum through subgroups when `subgroups`.
fn split_source(wg: u32, subgroups: bool) -> String {
    let (reduce, sg_args, sg_call) =
        if subgroups { (REDUCE_SUBGROUP, SG_ARGS, SG_CALL) } else { (REDUCE_SHARED, "", "") };
    include_str!("shaders/norm_split.wgsl")
        .replace("{{NORM_PARAMS}}", NORM_PARAMS)
        .replace("{{NORM_IO_VEC4}}", NORM_IO_VEC4)
        .replace("{{WG}}", &wg.to_string())
        .replace("{{RED_LEN}}", &wg.to_string())
        .replace("{{REDUCE}}", reduce)
        .replace("{{SG_ARGS}}", sg_args)
        .replace("{{SG_CALL}}", sg_call)
}

/// The workgroup sum through subgroups: one `subgroupAdd` each, their sums through workgroup
/// memory (slots `k * WG..`, so two reductions in a row need no barrier between them).
const REDUCE_SUBGROUP: &str = "fn reduce_sum(v: f32, k: u32, lid: u32, sg_id: u32, sg_lane: u32, n_sg: u32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane == 0u) {
        red[k * WG + sg_id] = s;
    }
    workgroupBarrier();
    var r = 0.0;
    for (var i = 0u; i < n_sg; i++) {
        r += red[k * WG + i];
    }
    return r;
}";

/// The workgroup sum as a tree through workgroup memory (slots `k * WG..`).
const REDUCE_SHARED: &str = "fn reduce_sum(v: f32, k: u32, lid: u32) -> f32 {
    let o = k * WG;
    red[o + lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[o + lid] += red[o + lid + s];
        }
        workgroupBarrier();
    }
    return red[o];
}";

/// Which norm kernel [`WgpuBackend::norm_with_kernel`] runs (tests compare each with the CPU).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKernel {
    /// `norm.wgsl`.
    Loop,
    /// `norm_reg.wgsl` with `wg` invocations per row, through subgroups or workgroup memory only.
    Registers {
        /// Invocations per workgroup (a power of two, 32 or more).
        wg: u32,
        /// Subgroup reductions and shuffles (the device must have them).
        subgroups: bool,
    },
    /// `norm_split.wgsl` (one row, RMS norm, whole 32-value blocks): a workgroup per block.
    Split {
        /// Subgroup reductions (the device must have them).
        subgroups: bool,
    },
}

/// A norm's dispatch taken out of the pending list by [`WgpuBackend::take_norm_for_router`],
/// with a copy of its parameters and the flush count it was taken at.
pub(super) struct HeldNorm {
    cmd: super::Cmd,
    params: Vec<u8>,
    flushes: u64,
}

impl WgpuBackend {
    /// `norm_reg`'s shape for rows of `width`, `None` for `norm.wgsl`.
    pub(super) fn norm_shape(&self, width: usize) -> Option<NormShape> {
        NormShape::for_width(width, self.max_workgroup_invocations(), self.ctx.norm_choice)
    }

    fn max_workgroup_invocations(&self) -> u32 {
        let limits = self.ctx.device.limits();
        limits.max_compute_invocations_per_workgroup.min(limits.max_compute_workgroup_size_x)
    }

    /// RMS norm (`mode` 0) or layer norm (`mode` 1) of every row of `x`, times `weight`, plus
    /// `bias`; a decode row (one token, whole 32-value blocks, int8 activations on) also gets its
    /// int8 blocks, registered for the products that read it.
    pub(super) fn norm(
        &self,
        op: &'static str,
        x: &WgpuTensor,
        weight: Option<&WgpuTensor>,
        bias: Option<&WgpuTensor>,
        eps: f32,
        mode: u32,
    ) -> Result<WgpuTensor, OpError> {
        let w = x.width();
        Self::check_norm(op, x, weight, bias)?;
        let y = self.alloc(op, &x.shape)?;
        // The products after a decode norm take int8 activations: the norm writes them too.
        let q8 = self.q8_epilogue_target(&y, true);
        let split = self.ctx.norm_choice == NormChoice::Auto
            && self.ctx.norm_split
            && mode == 0
            && x.rows() == 1
            && w.is_multiple_of(32);
        let (pipe, groups) = match self.norm_shape(w) {
            _ if split => {
                let wg = split_workgroup(w);
                let key = format!("norm_split {wg} sg{}", self.ctx.subgroups);
                // Workgroup memory is written before it is read (argued in norm_split.wgsl).
                (self.ctx.pipeline_with(&key, || split_source(wg, self.ctx.subgroups), true), w / 32)
            }
            Some(shape) => (self.norm_reg_pipeline(shape, self.ctx.subgroups), x.rows()),
            None => (self.plain(Plain::Norm), x.rows()),
        };
        let q8 = q8.as_ref().map(|(q, d)| (q, d));
        self.norm_dispatch(pipe, x, weight, bias, &y, q8, eps, mode, groups);
        if q8.is_some() {
            self.q8_register(&y.buf.buffer, w);
        }
        Ok(y)
    }

    /// `(rms_norm(a, wa), rms_norm(b, wb))` of rows of one width in one dispatch of
    /// [`NormShape::pair_source`]; two norms where `norm_reg` does not take the width, the
    /// weights are missing, `DISKFORMER_NORM` picks another kernel, or on odd decode steps under
    /// `DISKFORMER_AB=qknorm`.
    pub(super) fn norm_pair(
        &self,
        [(a, wa), (b, wb)]: [(&WgpuTensor, Option<&WgpuTensor>); 2],
        eps: f32,
    ) -> Result<(WgpuTensor, WgpuTensor), OpError> {
        let op = "rms_norm_pair";
        let shape = self.norm_shape(a.width()).filter(|_| {
            a.width() == b.width()
                && self.ctx.norm_choice == NormChoice::Auto
                && a.rows() > 0
                && b.rows() > 0
                && !crate::ab::is_b("qknorm")
        });
        let (Some(shape), Some(wa), Some(wb)) = (shape, wa, wb) else {
            return Ok((self.norm("rms_norm", a, wa, None, eps, 0)?, self.norm("rms_norm", b, wb, None, eps, 0)?));
        };
        Self::check_norm(op, a, Some(wa), None)?;
        Self::check_norm(op, b, Some(wb), None)?;
        let (ya, yb) = (self.alloc(op, &a.shape)?, self.alloc(op, &b.shape)?);
        let subgroups = self.ctx.subgroups;
        // Workgroup memory is written before it is read (argued in norm_reg.wgsl).
        let pipe = self.ctx.pipeline_with(&shape.pair_key(subgroups), || shape.pair_source(subgroups), true);
        let rows = a.rows() + b.rows();
        // No int8 blocks: `ya` fills their bindings (see `norm_dispatch`), the dummy the bias's.
        self.dispatch(
            pipe,
            &[
                &a.buf.buffer,
                &wa.buf.buffer,
                &self.ctx.dummy,
                &ya.buf.buffer,
                &ya.buf.buffer,
                &ya.buf.buffer,
                &b.buf.buffer,
                &wb.buf.buffer,
                &yb.buf.buffer,
            ],
            &[a.width() as u32, rows as u32, 0, eps.to_bits(), 1, 0, 0, a.rows() as u32],
            super::grid(rows),
        );
        Ok((ya, yb))
    }

    fn check_norm(
        op: &'static str,
        x: &WgpuTensor,
        weight: Option<&WgpuTensor>,
        bias: Option<&WgpuTensor>,
    ) -> Result<(), OpError> {
        let w = x.width();
        for t in [weight, bias].into_iter().flatten() {
            if t.len() != w {
                return Err(OpError::ShapeMismatch { op, expected: format!("weight of {w}"), got: t.shape.clone() });
            }
        }
        Ok(())
    }

    fn norm_reg_pipeline(&self, shape: NormShape, subgroups: bool) -> std::sync::Arc<wgpu::ComputePipeline> {
        // Workgroup memory is written before it is read (argued in norm_reg.wgsl).
        self.ctx.pipeline_with(&shape.key(subgroups), || shape.source(subgroups), true)
    }

    /// Records one norm dispatch (both kernels take the same bindings and parameters); `q8`: the
    /// buffers for the int8 blocks of every row.
    #[allow(clippy::too_many_arguments)]
    fn norm_dispatch(
        &self,
        pipe: std::sync::Arc<wgpu::ComputePipeline>,
        x: &WgpuTensor,
        weight: Option<&WgpuTensor>,
        bias: Option<&WgpuTensor>,
        y: &WgpuTensor,
        q8: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
        eps: f32,
        mode: u32,
        groups: usize,
    ) {
        let wb = weight.map_or(&self.ctx.dummy, |t| &t.buf.buffer);
        let bb = bias.map_or(&self.ctx.dummy, |t| &t.buf.buffer);
        // Without int8 output the kernel writes no blocks; `y` fills their bindings (the dummy is
        // bound read-only above, and one buffer may not be both read-only and writable).
        let (qs, ds) = q8.unwrap_or((&y.buf.buffer, &y.buf.buffer));
        let mark = (x.rows() == 1 && mode == 0 && bias.is_none())
            .then(|| {
                weight.map(|w| super::NormMark {
                    x: x.buf.buffer.clone(),
                    weight: w.buf.buffer.clone(),
                    y: y.buf.buffer.clone(),
                    eps,
                })
            })
            .flatten();
        self.dispatch(
            pipe,
            &[&x.buf.buffer, wb, bb, &y.buf.buffer, qs, ds],
            &[
                x.width() as u32,
                x.rows() as u32,
                mode,
                eps.to_bits(),
                weight.is_some() as u32,
                bias.is_some() as u32,
                q8.is_some() as u32,
                0,
            ],
            super::grid(groups),
        );
        super::lock(&self.ctx.pending).norm_mark = mark;
    }

    /// The last pending command when it is the one-row RMS norm (with a weight) that wrote `h`,
    /// taken out of the pending list, and what it norms: for the router variant that norms its
    /// input itself (`moe_route.wgsl`'s `//F` lines), so that the norm's own dispatch, which the
    /// GPU's experts still read, runs after the routing and off the chain from the CPU's sum to
    /// the ids. `None` (nothing taken) otherwise, on odd decode steps under
    /// `DISKFORMER_AB=ffnnorm`, or with `DISKFORMER_ROUTER_NORM=apart`. The caller puts it back
    /// with [`Self::put_norm_back`].
    pub(super) fn take_norm_for_router(&self, h: &WgpuTensor) -> Option<(HeldNorm, super::NormMark)> {
        static APART: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let apart = *APART.get_or_init(|| std::env::var("DISKFORMER_ROUTER_NORM").is_ok_and(|v| v.trim() == "apart"));
        if apart || crate::ab::is_b("ffnnorm") || !self.ctx.fuse || h.rows() != 1 {
            return None;
        }
        let mut p = super::lock(&self.ctx.pending);
        let mark = p.norm_mark.clone().filter(|m| m.y == h.buf.buffer)?;
        let is_it = matches!(p.cmds.last(), Some(super::Cmd::Dispatch { buffers, .. })
            if buffers.first() == Some(&mark.x) && buffers.get(1) == Some(&mark.weight) && buffers.get(3) == Some(&mark.y));
        if !is_it {
            return None;
        }
        p.norm_mark = None;
        let cmd = p.cmds.pop()?;
        let super::Cmd::Dispatch { params_at, params_len, .. } = &cmd else { return None };
        let (at, len) = (*params_at as usize, *params_len as usize);
        let params = p.params[at..at + len].to_vec();
        let flushes = p.flushes;
        Some((HeldNorm { cmd, params, flushes }, mark))
    }

    /// Puts a norm [`Self::take_norm_for_router`] took back at the end of the pending list:
    /// `after_route` when the routing kernel was recorded in its place (the int8 blocks the norm
    /// wrote stay known to the int8 cache at the norm's new place), else where it was.
    pub(super) fn put_norm_back(&self, held: HeldNorm, after_route: bool) {
        let HeldNorm { mut cmd, params, flushes } = held;
        let mut p = super::lock(&self.ctx.pending);
        if p.flushes != flushes {
            // An early submit inside the routing's recording took the parameters the norm's
            // offset pointed at (and the int8 cache's entry with them): they go in again.
            let at = p.params.len().next_multiple_of(self.ctx.params_align);
            p.params.resize(at, 0);
            p.params.extend_from_slice(&params);
            if let super::Cmd::Dispatch { params_at, .. } = &mut cmd {
                *params_at = at as u64;
            }
        }
        let at = p.cmds.len();
        p.cmds.push(cmd);
        if after_route {
            p.norm_after_route = Some(at);
            drop(p);
            self.q8_marker_moved(at, at + 1);
        }
    }

    /// The RMS norm (or layer norm when `layer`) of every row of `x` through `kernel`, with the
    /// int8 blocks of every row when `q8` (rows of whole 32-value blocks): for tests, which compare
    /// each kernel with the CPU and its blocks with `quantize_q8`'s of the result.
    ///
    /// # Errors
    /// [`OpError::ShapeMismatch`] for a weight or bias of the wrong size, or int8 blocks asked for
    /// rows that are not whole blocks; [`OpError::Unsupported`] when `kernel` cannot take the
    /// width or the device has no subgroups.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn norm_with_kernel(
        &self,
        x: &WgpuTensor,
        weight: Option<&WgpuTensor>,
        bias: Option<&WgpuTensor>,
        eps: f32,
        layer: bool,
        kernel: NormKernel,
        q8: bool,
    ) -> Result<(WgpuTensor, Option<Q8Act>), OpError> {
        let op = "norm_with_kernel";
        Self::check_norm(op, x, weight, bias)?;
        let width = x.width();
        if q8 && !width.is_multiple_of(32) {
            return Err(OpError::ShapeMismatch {
                op,
                expected: "rows of whole 32-value blocks for int8 blocks".into(),
                got: x.shape.clone(),
            });
        }
        let unsupported = |why: String| OpError::Unsupported { op, backend: "wgpu", why };
        let sg = match kernel {
            NormKernel::Registers { subgroups, .. } | NormKernel::Split { subgroups } => subgroups,
            NormKernel::Loop => false,
        };
        if sg && !self.ctx.subgroups {
            return Err(unsupported("subgroups asked for, the device has none in use".into()));
        }
        let (pipe, groups) = match kernel {
            NormKernel::Loop => (self.plain(Plain::Norm), x.rows()),
            NormKernel::Registers { wg, subgroups } => {
                let shape = NormShape::for_width(width, self.max_workgroup_invocations(), NormChoice::Wg(wg))
                    .ok_or_else(|| unsupported(format!("norm_reg with {wg} invocations cannot take width {width}")))?;
                (self.norm_reg_pipeline(shape, subgroups), x.rows())
            }
            NormKernel::Split { subgroups } => {
                if layer || x.rows() != 1 || !width.is_multiple_of(32) {
                    return Err(unsupported(format!(
                        "norm_split takes one row of whole 32-value blocks, RMS norm (got {:?}, layer {layer})",
                        x.shape
                    )));
                }
                let wg = split_workgroup(width);
                let key = format!("norm_split {wg} sg{subgroups}");
                (self.ctx.pipeline_with(&key, || split_source(wg, subgroups), true), width / 32)
            }
        };
        let y = self.alloc(op, &x.shape)?;
        let blocks = if q8 {
            let qs = self.alloc_bytes("norm_with_kernel qs", x.len() as u64)?;
            let ds = self.alloc_bytes("norm_with_kernel ds", 8 * (x.len() / 32) as u64)?;
            Some(Q8Act { qs, ds, n_tok: x.rows(), width })
        } else {
            None
        };
        let q8_buffers = blocks.as_ref().map(|b| (&b.qs.buffer, &b.ds.buffer));
        self.norm_dispatch(pipe, x, weight, bias, &y, q8_buffers, eps, layer as u32, groups);
        Ok((y, blocks))
    }

    /// The int8 blocks of `q` on the host: the packed bytes (four to a word) and per block the
    /// scale and the scale times the sum of the bytes (for tests).
    ///
    /// # Errors
    /// The device is lost while reading.
    #[doc(hidden)]
    pub fn q8_act_to_host(&self, q: &Q8Act) -> Result<(Vec<u32>, Vec<f32>), OpError> {
        let n_values = q.n_tok * q.width;
        let qs = self.read_back(&q.qs.buffer, n_values as u64)?;
        let ds = self.read_back(&q.ds.buffer, 8 * (n_values / 32) as u64)?;
        Ok((bytemuck::pod_collect_to_vec(&qs), bytemuck::pod_collect_to_vec(&ds)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_the_row_within_the_limits() {
        let auto = |w| NormShape::for_width(w, 1024, NormChoice::Auto);
        assert_eq!(auto(4096), Some(NormShape { wg: 256, nv: 4 }));
        assert_eq!(auto(128), Some(NormShape { wg: 32, nv: 1 }));
        assert_eq!(auto(96), Some(NormShape { wg: 32, nv: 1 }));
        assert_eq!(auto(8224), Some(NormShape { wg: 512, nv: 5 }));
        assert_eq!(auto(32768), Some(NormShape { wg: 1024, nv: 8 }));
        assert_eq!(auto(32772), None);
        assert_eq!(auto(333), None);
        assert_eq!(NormShape::for_width(16384, 256, NormChoice::Auto), None);
        assert_eq!(NormShape::for_width(4096, 1024, NormChoice::Old), None);
        assert_eq!(NormShape::for_width(4096, 1024, NormChoice::Wg(1024)), Some(NormShape { wg: 1024, nv: 1 }));
        assert_eq!(NormShape::for_width(4096, 256, NormChoice::Wg(1024)), None);
    }

    #[test]
    fn every_norm_reg_variant_parses_and_validates() {
        for wg in [32, 64, 256, 1024] {
            for nv in [1, 4, 16] {
                for sg in [false, true] {
                    super::super::shaders::tests::parse(&format!("{wg}x{nv} sg{sg}"), &NormShape { wg, nv }.source(sg));
                    let pair = NormShape { wg, nv }.pair_source(sg);
                    super::super::shaders::tests::parse(&format!("pair {wg}x{nv} sg{sg}"), &pair);
                }
            }
        }
    }
}
