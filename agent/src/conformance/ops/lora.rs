//! The conformance case of `lora_add` ([`Capability::Lora`]): two adapters' groups of rows (one
//! of f32 weights, one of bf16) in a strided input window and an output window inside a wider
//! buffer, with rows in no group between and after them, which must come back untouched.

use npu_backend::{Backend, BackendError, Capability, DType, Layout, LoraGroup, View, ViewMut};

use super::{filled, out, read, window, Output, Rng};
use crate::conformance::Class;

/// Values bf16 holds exactly (so f32 and bf16 weights name the same numbers).
fn bf16_exact(rng: &mut Rng, n: usize) -> Vec<f32> {
    rng.values(n, 1.0)
        .into_iter()
        .map(|v| half::bf16::from_f32(v).to_f32())
        .collect()
}

pub(super) fn lora<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let c = Capability::Lora;
    if !b.supports(c) {
        return Ok(Vec::new());
    }
    let act = b.act_dtype();
    let (rows, n_in, n_out) = (13usize, 96usize, 40usize);
    let (r1, r2) = (8usize, 3usize);
    let mut rng = Rng(131);
    let xw = window(rows, n_in, 4, n_in + 9);
    let x = filled(b, act, rows * (n_in + 9), xw, &rng.values(rows * n_in, 2.0))?;
    let ow = window(rows, n_out, 5, n_out + 7);
    let mut o = filled(
        b,
        act,
        rows * (n_out + 7),
        ow,
        &rng.values(rows * n_out, 1.0),
    )?;
    let mut weights = |dtype: DType, n: usize| -> Result<B::Buffer, BackendError> {
        let v = bf16_exact(&mut rng, n);
        filled(b, dtype, n, Layout::contiguous(1, n), &v)
    };
    let a1 = weights(DType::F32, r1 * n_in)?;
    let b1 = weights(DType::F32, r1 * n_out)?;
    let a2 = weights(DType::BF16, r2 * n_in)?;
    let b2 = weights(DType::BF16, r2 * n_out)?;
    let groups = [
        LoraGroup {
            row: 1,
            n: 5,
            a: &a1,
            b_t: &b1,
            rank: r1,
            scale: 2.0,
        },
        LoraGroup {
            row: 8,
            n: 3,
            a: &a2,
            b_t: &b2,
            rank: r2,
            scale: 0.5,
        },
    ];
    b.lora_add(View::new(&x, xw)?, &groups, ViewMut::new(&mut o, ow)?)?;
    Ok(vec![out(
        format!(
            "{}: two adapters' row groups (f32 and bf16 weights) in windows",
            c.name()
        ),
        Class::Reduction,
        read(b, &o, ow)?,
    )])
}
