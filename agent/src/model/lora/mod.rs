//! Multi-LoRA on a loaded model: a fixed number of adapter slots holding adapters' weights on
//! the backend (`load`/`unload` by slot), each step's per-token choice of slot turned into runs
//! of consecutive rows, and the adapters' low-rank products added to the targeted projections'
//! outputs in one `Backend::lora_add` per projection and layer (every adapter of the step
//! together). Which adapter sits in which slot, and when one is evicted, is the caller's
//! (`pool`). Adapters are read from PEFT directories (`adapter`) or llama.cpp's GGUF LoRA files
//! (`gguf_adapter`).

pub mod merge;
pub mod pool;
pub mod synth;

use npu_backend::{Backend, Capability, DType, HostSlice, LoraGroup, View, ViewMut};

/// The readers live in `npu_model::lora` (the server checks adapters with them too).
pub use npu_model::lora::{adapter, gguf_adapter};
pub use npu_model::lora::{AdapterError, HostAdapter, LowRank, Target};

use super::{Model, ModelConfig, ModelError};

/// Slot 0 of a token: the base model, no adapter; slot `s` (1..=slots) is adapter slot `s - 1`.
pub const BASE: u16 = 0;

struct DevicePair<B: Backend> {
    a: B::Buffer,
    b_t: B::Buffer,
}

struct SlotWeights<B: Backend> {
    rank: usize,
    scale: f32,
    layers: Vec<[Option<DevicePair<B>>; 7]>,
}

/// A run of a step's rows on one adapter slot (1-based, as in the step's per-token slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub row: usize,
    pub n: usize,
    pub slot: u16,
}

/// The adapter slots of a model (none until `Model::enable_lora`).
pub struct LoraSlots<B: Backend> {
    slots: Vec<Option<SlotWeights<B>>>,
    pub max_rank: usize,
    /// This step's runs (empty: every row on the base model).
    runs: Vec<Run>,
}

impl<B: Backend> Default for LoraSlots<B> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            max_rank: 0,
            runs: Vec::new(),
        }
    }
}

impl<B: Backend> LoraSlots<B> {
    /// `n` empty slots for adapters of rank up to `max_rank`, on a backend that has
    /// [`Capability::Lora`] (refused by name otherwise) and a family adapters can target.
    pub fn new(b: &B, cfg: &ModelConfig, n: usize, max_rank: usize) -> Result<Self, ModelError> {
        if !b.supports(Capability::Lora) {
            return Err(ModelError::Unsupported(format!(
                "{}, which the {} backend does not have yet",
                Capability::Lora.name(),
                b.kind().name()
            )));
        }
        adapter::check_family(cfg).map_err(ModelError::Unsupported)?;
        if n == 0 || n >= u16::MAX as usize || max_rank == 0 || max_rank > 256 {
            return Err(ModelError::BadOptions(format!(
                "max_loras {n} (1..65534) and max_lora_rank {max_rank} (1..=256)"
            )));
        }
        Ok(Self {
            slots: (0..n).map(|_| None).collect(),
            max_rank,
            runs: Vec::new(),
        })
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Places `ad` in slot `slot` (0-based), replacing what was there.
    pub fn load(
        &mut self,
        b: &mut B,
        cfg: &ModelConfig,
        slot: usize,
        ad: &HostAdapter,
    ) -> Result<(), ModelError> {
        if slot >= self.slots.len() {
            return Err(ModelError::BadOptions(format!(
                "LoRA slot {slot} of {}",
                self.slots.len()
            )));
        }
        if ad.rank > self.max_rank {
            return Err(ModelError::BadOptions(format!(
                "adapter {} has rank {} above max_lora_rank {}",
                ad.path.display(),
                ad.rank,
                self.max_rank
            )));
        }
        if ad.layers.len() != cfg.n_layers {
            return Err(ModelError::Inconsistent(format!(
                "adapter {} has {} layers, the model {}",
                ad.path.display(),
                ad.layers.len(),
                cfg.n_layers
            )));
        }
        self.slots[slot] = None;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in &ad.layers {
            let mut per: [Option<DevicePair<B>>; 7] = Default::default();
            for t in Target::ALL {
                if let Some(lr) = &l[t.index()] {
                    let (n_in, n_out) = t.dims(cfg);
                    if lr.a.len() != ad.rank * n_in || lr.b_t.len() != ad.rank * n_out {
                        return Err(ModelError::Inconsistent(format!(
                            "adapter {}: {} of the wrong size",
                            ad.path.display(),
                            t.peft_name()
                        )));
                    }
                    let dtype = if ad.all_bf16 { DType::BF16 } else { DType::F32 };
                    per[t.index()] = Some(DevicePair {
                        a: upload(b, &lr.a, dtype)?,
                        b_t: upload(b, &lr.b_t, dtype)?,
                    });
                }
            }
            layers.push(per);
        }
        self.slots[slot] = Some(SlotWeights {
            rank: ad.rank,
            scale: ad.scale,
            layers,
        });
        Ok(())
    }

    /// Empties slot `slot` (0-based).
    pub fn unload(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    pub fn is_loaded(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(Option::is_some)
    }

    /// Sets this step's per-token slots (`BASE` or 1-based; empty: all base) for `t` rows.
    pub fn set_step(&mut self, per_token: &[u16], t: usize) -> Result<(), ModelError> {
        self.runs.clear();
        if per_token.is_empty() {
            return Ok(());
        }
        if per_token.len() != t {
            return Err(ModelError::BadOptions(format!(
                "{} per-token LoRA slots for a step of {t} tokens",
                per_token.len()
            )));
        }
        for (row, &s) in per_token.iter().enumerate() {
            if s == BASE {
                continue;
            }
            if !self.is_loaded(s as usize - 1) {
                return Err(ModelError::BadOptions(format!(
                    "token row {row} asks for LoRA slot {} ({} slots), which holds no adapter",
                    s - 1,
                    self.slots.len()
                )));
            }
            match self.runs.last_mut() {
                Some(r) if r.slot == s && r.row + r.n == row => r.n += 1,
                _ => self.runs.push(Run { row, n: 1, slot: s }),
            }
        }
        Ok(())
    }

    /// Forgets the step's runs (every step sets its own).
    pub fn end_step(&mut self) {
        self.runs.clear();
    }

    /// The step's runs (after `set_step`).
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Whether an adapter of the step targets `t` in `layer` (`apply` adds something).
    pub fn targets(&self, layer: usize, t: Target) -> bool {
        self.runs.iter().any(|r| {
            (r.slot as usize)
                .checked_sub(1)
                .and_then(|i| self.slots.get(i)?.as_ref())
                .and_then(|s| s.layers.get(layer))
                .is_some_and(|l| l[t.index()].is_some())
        })
    }

    /// `out += scale * B (A x)` for the step's rows of every adapter targeting `t` in `layer`.
    pub fn apply(
        &self,
        b: &mut B,
        layer: usize,
        t: Target,
        x: View<'_, B::Buffer>,
        out: ViewMut<'_, B::Buffer>,
    ) -> Result<(), ModelError> {
        if self.runs.is_empty() {
            return Ok(());
        }
        let groups: Vec<LoraGroup<'_, B::Buffer>> = self
            .runs
            .iter()
            .filter_map(|r| {
                let s = self.slots.get(r.slot as usize - 1)?.as_ref()?;
                let p = s.layers.get(layer)?[t.index()].as_ref()?;
                Some(LoraGroup {
                    row: r.row,
                    n: r.n,
                    a: &p.a,
                    b_t: &p.b_t,
                    rank: s.rank,
                    scale: s.scale,
                })
            })
            .collect();
        if groups.is_empty() {
            return Ok(());
        }
        b.lora_add(x, &groups, out)?;
        Ok(())
    }
}

impl<B: Backend> Model<B> {
    /// Gives the model `max_loras` adapter slots for adapters of rank up to `max_rank`.
    /// Refused by name on a backend without [`Capability::Lora`], on a family adapters cannot
    /// target here, and over tensor-parallel ranks.
    pub fn enable_lora(&mut self, max_loras: usize, max_rank: usize) -> Result<(), ModelError> {
        let (slots, b, cfg, tp) = self.lora_parts();
        if tp {
            return Err(ModelError::Unsupported(
                "LoRA adapters over tensor-parallel ranks are not built".into(),
            ));
        }
        *slots = LoraSlots::new(b, cfg, max_loras, max_rank)?;
        Ok(())
    }

    /// Adapter slots (0 until `enable_lora`).
    pub fn lora_slot_count(&mut self) -> usize {
        self.lora_parts().0.len()
    }

    /// Reads an adapter for this model (checked against its shapes and `max_lora_rank`): a
    /// PEFT directory, or a GGUF LoRA file (a path that is a file).
    pub fn read_lora(&mut self, dir: &std::path::Path) -> Result<HostAdapter, ModelError> {
        let (slots, _, cfg, _) = self.lora_parts();
        if slots.is_empty() {
            return Err(ModelError::BadOptions(
                "LoRA is not enabled (max_loras)".into(),
            ));
        }
        Ok(npu_model::lora::read_adapter(dir, cfg, slots.max_rank)?)
    }

    /// Places `ad` in slot `slot` (0-based).
    pub fn load_lora(&mut self, slot: usize, ad: &HostAdapter) -> Result<(), ModelError> {
        let (slots, b, cfg, _) = self.lora_parts();
        slots.load(b, cfg, slot, ad)
    }

    /// Empties slot `slot` (0-based).
    pub fn unload_lora(&mut self, slot: usize) {
        self.lora_parts().0.unload(slot);
    }

    /// The next step's adapter per token row: [`BASE`] or a 1-based slot (empty: all base). It
    /// holds for one `forward` only.
    pub fn set_step_lora(&mut self, per_token: &[u16], t: usize) -> Result<(), ModelError> {
        self.lora_parts().0.set_step(per_token, t)
    }
}

/// `v` in a new buffer of `dtype` (bf16 only for values read from bf16: exact).
fn upload<B: Backend>(b: &mut B, v: &[f32], dtype: DType) -> Result<B::Buffer, ModelError> {
    let mut buf = b.alloc(dtype, v.len())?;
    b.upload(HostSlice::F32(v), ViewMut::rows(&mut buf, 1, v.len())?)?;
    Ok(buf)
}
