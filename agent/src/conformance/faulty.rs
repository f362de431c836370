//! A backend that is wrong on purpose, to prove the suite fails what is wrong: it does what the
//! backend it wraps does, except that one chosen op gets its output perturbed (or, for the KV
//! ops, moves the wrong data). Used only by the suite's own test.

use npu_backend::{
    AttnGeometry, Backend, BackendError, DType, DeviceKind, HostSlice, HostSliceMut, HostTensor,
    KvSpec, MemInfo, Readback, StepInputs, View, ViewMut,
};

/// The op `Faulty` gets wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Upload,
    Embed,
    RmsNorm,
    Matmul,
    AddBias,
    Rope,
    KvWrite,
    Attention,
    Swiglu,
    Add,
    GatherLogitRows,
    ArgmaxRows,
    KvCopyBlocks,
    RmsNormHeads,
    ScaleRows,
    Geglu,
    MoeFfn,
    LoraAdd,
}

impl Fault {
    pub const ALL: [Fault; 18] = [
        Fault::Upload,
        Fault::Embed,
        Fault::RmsNorm,
        Fault::Matmul,
        Fault::AddBias,
        Fault::Rope,
        Fault::KvWrite,
        Fault::Attention,
        Fault::Swiglu,
        Fault::Add,
        Fault::GatherLogitRows,
        Fault::RmsNormHeads,
        Fault::ScaleRows,
        Fault::Geglu,
        Fault::MoeFfn,
        Fault::ArgmaxRows,
        Fault::KvCopyBlocks,
        Fault::LoraAdd,
    ];

    /// Words that name the checks this fault must fail (one of them at least).
    pub fn check_names(self) -> &'static [&'static str] {
        match self {
            Fault::Upload => &["upload"],
            Fault::Embed => &["embed"],
            Fault::RmsNorm => &["rms_norm"],
            Fault::Matmul => &["matmul"],
            Fault::AddBias => &["add_bias"],
            Fault::Rope => &["rope"],
            Fault::KvWrite => &["kv_write"],
            Fault::Attention => &["attention"],
            Fault::Swiglu => &["swiglu"],
            Fault::Add => &["add on"],
            Fault::GatherLogitRows => &["gather_logit_rows"],
            Fault::ArgmaxRows => &["argmax_rows"],
            Fault::KvCopyBlocks => &["kv_copy_blocks"],
            Fault::RmsNormHeads => &["per-head Q/K RMS norm"],
            Fault::ScaleRows => &["row scaling"],
            Fault::Geglu => &["GELU-gated FFN"],
            Fault::MoeFfn => &["mixture-of-experts routing: expert FFN"],
            Fault::LoraAdd => &["LoRA adapters"],
        }
    }
}

pub struct Faulty<B: Backend> {
    pub inner: B,
    pub fault: Fault,
}

impl<B: Backend> Faulty<B> {
    /// Adds one plus its magnitude to the first value of every row of `out`'s window.
    fn perturb(&mut self, out: &mut ViewMut<'_, B::Buffer>) -> Result<(), BackendError> {
        let layout = out.layout();
        if layout.elements() == 0 {
            return Ok(());
        }
        let mut host = vec![0f32; layout.elements()];
        if out.dtype() == DType::I32 {
            let mut ids = vec![0i32; layout.elements()];
            self.inner.read_back(&mut [Readback {
                src: out.as_view(),
                dst: HostSliceMut::I32(&mut ids),
            }])?;
            for row in ids.chunks_mut(layout.cols()) {
                // Wrapping: the memory case uploads i32::MAX (MIN is still a wrong value).
                row[0] = row[0].wrapping_add(1);
            }
            return self
                .inner
                .upload(HostSlice::I32(&ids), ViewMut::new(out.buf_mut(), layout)?);
        }
        self.inner.read_back(&mut [Readback {
            src: out.as_view(),
            dst: HostSliceMut::F32(&mut host),
        }])?;
        for row in host.chunks_mut(layout.cols()) {
            row[0] += 1.0 + row[0].abs();
        }
        self.inner
            .upload(HostSlice::F32(&host), ViewMut::new(out.buf_mut(), layout)?)
    }

    /// Runs `op` on a view that borrows `out`, then perturbs `out` when `fault` is this one.
    fn then_perturb<T>(
        &mut self,
        fault: Fault,
        out: &mut ViewMut<'_, B::Buffer>,
        op: impl FnOnce(&mut B, ViewMut<'_, B::Buffer>) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let cols = out.layout().cols();
        let r = op(&mut self.inner, out.col_range(0, cols)?)?;
        if self.fault == fault {
            self.perturb(out)?;
        }
        Ok(r)
    }
}

impl<B: Backend> Backend for Faulty<B> {
    type Buffer = B::Buffer;
    type Matrix = B::Matrix;
    type Embedding = B::Embedding;

    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }
    fn describe(&self) -> String {
        format!("{} with a faulty {:?}", self.inner.describe(), self.fault)
    }
    fn act_dtype(&self) -> DType {
        self.inner.act_dtype()
    }
    fn choose_activations(&mut self, wide: bool) {
        self.inner.choose_activations(wide)
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.inner.mem_info()
    }
    fn supports(&self, c: npu_backend::Capability) -> bool {
        self.inner.supports(c)
    }
    fn rms_norm_heads(
        &mut self,
        mut x: ViewMut<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::RmsNormHeads, &mut x, |b, o| {
            b.rms_norm_heads(o, w, eps, head_dim)
        })
    }
    fn scale_rows(&mut self, mut x: ViewMut<'_, Self::Buffer>, s: f32) -> Result<(), BackendError> {
        self.then_perturb(Fault::ScaleRows, &mut x, |b, o| b.scale_rows(o, s))
    }
    fn lora_add(
        &mut self,
        x: View<'_, Self::Buffer>,
        groups: &[npu_backend::LoraGroup<'_, Self::Buffer>],
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::LoraAdd, &mut out, |b, o| b.lora_add(x, groups, o))
    }
    fn geglu(
        &mut self,
        gate: View<'_, Self::Buffer>,
        up: View<'_, Self::Buffer>,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Geglu, &mut out, |b, o| b.geglu(gate, up, o))
    }
    fn moe_route(
        &mut self,
        logits: View<'_, Self::Buffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, Self::Buffer>,
        weights: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.inner.moe_route(logits, k, normalize, ids, weights)
    }
    fn moe_ffn(
        &mut self,
        x: View<'_, Self::Buffer>,
        ids: View<'_, Self::Buffer>,
        weights: View<'_, Self::Buffer>,
        gate_up: &[Self::Matrix],
        down: &[Self::Matrix],
        ff: usize,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::MoeFfn, &mut out, |b, o| {
            b.moe_ffn(x, ids, weights, gate_up, down, ff, o)
        })
    }
    fn moe_ffn_held(
        &mut self,
        x: View<'_, Self::Buffer>,
        ids: View<'_, Self::Buffer>,
        weights: View<'_, Self::Buffer>,
        gate_up: &[Self::Matrix],
        down: &[Self::Matrix],
        held: std::ops::Range<usize>,
        n_experts: usize,
        ff: usize,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::MoeFfn, &mut out, |b, o| {
            b.moe_ffn_held(x, ids, weights, gate_up, down, held, n_experts, ff, o)
        })
    }
    fn alloc(&mut self, dtype: DType, len: usize) -> Result<Self::Buffer, BackendError> {
        self.inner.alloc(dtype, len)
    }
    fn upload(
        &mut self,
        src: HostSlice<'_>,
        mut dst: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Upload, &mut dst, |b, d| b.upload(src, d))
    }
    fn read_back(&mut self, reads: &mut [Readback<'_, Self::Buffer>]) -> Result<(), BackendError> {
        self.inner.read_back(reads)
    }
    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.inner.synchronize()
    }
    fn load_matrix(
        &mut self,
        parts: &[HostTensor<'_>],
    ) -> Result<Option<Self::Matrix>, BackendError> {
        self.inner.load_matrix(parts)
    }
    fn load_experts(
        &mut self,
        experts: &[Vec<HostTensor<'_>>],
    ) -> Result<Option<Vec<Self::Matrix>>, BackendError> {
        self.inner.load_experts(experts)
    }
    fn load_embedding(&mut self, table: HostTensor<'_>) -> Result<Self::Embedding, BackendError> {
        self.inner.load_embedding(table)
    }
    fn load_vector(&mut self, v: HostTensor<'_>) -> Result<Self::Buffer, BackendError> {
        self.inner.load_vector(v)
    }
    fn init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        self.inner.init_kv(spec)
    }
    fn kv_block_bytes(&self) -> usize {
        self.inner.kv_block_bytes()
    }
    fn kv_copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError> {
        if self.fault == Fault::KvCopyBlocks {
            // Copies every source into the first destination only.
            let first = pairs.first().map(|p| p.1).unwrap_or(0);
            let wrong: Vec<(u32, u32)> = pairs.iter().map(|&(s, _)| (s, first)).collect();
            return self.inner.kv_copy_blocks(&wrong);
        }
        self.inner.kv_copy_blocks(pairs)
    }
    fn kv_blocks_to_host(&mut self, blocks: &[u32], dst: &mut [u8]) -> Result<(), BackendError> {
        self.inner.kv_blocks_to_host(blocks, dst)
    }
    fn kv_blocks_from_host(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError> {
        self.inner.kv_blocks_from_host(src, blocks)
    }
    fn kv_layer_block_to_host(
        &mut self,
        layer: usize,
        block: u32,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        self.inner.kv_layer_block_to_host(layer, block, k, v)
    }
    fn kv_layer_block_from_host(
        &mut self,
        layer: usize,
        block: u32,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), BackendError> {
        self.inner.kv_layer_block_from_host(layer, block, k, v)
    }
    fn begin_step(&mut self, step: &StepInputs) -> Result<(), BackendError> {
        self.inner.begin_step(step)
    }
    fn embed(
        &mut self,
        table: &Self::Embedding,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Embed, &mut out, |b, o| b.embed(table, o))
    }
    fn rms_norm(
        &mut self,
        x: View<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::RmsNorm, &mut out, |b, o| b.rms_norm(x, w, eps, o))
    }
    fn matmul(
        &mut self,
        x: View<'_, Self::Buffer>,
        w: &Self::Matrix,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Matmul, &mut out, |b, o| b.matmul(x, w, o))
    }
    fn add_bias(
        &mut self,
        mut x: ViewMut<'_, Self::Buffer>,
        bias: &Self::Buffer,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::AddBias, &mut x, |b, o| b.add_bias(o, bias))
    }
    fn rope(
        &mut self,
        mut qk: ViewMut<'_, Self::Buffer>,
        g: &AttnGeometry,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Rope, &mut qk, |b, o| b.rope(o, g))
    }
    fn kv_write(
        &mut self,
        k: View<'_, Self::Buffer>,
        v: View<'_, Self::Buffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        if self.fault == Fault::KvWrite {
            // Writes V where K belongs.
            return self.inner.kv_write(v, v, g, layer);
        }
        self.inner.kv_write(k, v, g, layer)
    }
    fn attention(
        &mut self,
        q: View<'_, Self::Buffer>,
        g: &AttnGeometry,
        layer: usize,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Attention, &mut out, |b, o| {
            b.attention(q, g, layer, o)
        })
    }
    fn swiglu(
        &mut self,
        gate: View<'_, Self::Buffer>,
        up: View<'_, Self::Buffer>,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Swiglu, &mut out, |b, o| b.swiglu(gate, up, o))
    }
    fn add(
        &mut self,
        mut x: ViewMut<'_, Self::Buffer>,
        y: View<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::Add, &mut x, |b, o| b.add(o, y))
    }
    fn gather_logit_rows(
        &mut self,
        x: View<'_, Self::Buffer>,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        self.then_perturb(Fault::GatherLogitRows, &mut out, |b, o| {
            b.gather_logit_rows(x, o)
        })
    }
    fn argmax_rows(
        &mut self,
        logits: View<'_, Self::Buffer>,
        mut out: ViewMut<'_, Self::Buffer>,
    ) -> Result<bool, BackendError> {
        self.then_perturb(Fault::ArgmaxRows, &mut out, |b, o| b.argmax_rows(logits, o))
    }
    fn argmax_logprob_rows(
        &mut self,
        logits: View<'_, Self::Buffer>,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<bool, BackendError> {
        self.inner.argmax_logprob_rows(logits, out)
    }
}
