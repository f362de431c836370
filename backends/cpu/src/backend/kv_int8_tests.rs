//! The int8 KV pool: its block size (scales included) as planned, whole-block copies on the
//! device and through the host carrying values and scales, per-layer token rows converted, and
//! the latent pool refusing it.

use npu_backend::{Backend, DType, HostSlice, KvDtype, KvSpec, View, ViewMut};

use super::*;

fn backend() -> CpuBackend {
    let mut b = CpuBackend::new(CpuConfig {
        threads: 2,
        f32_reference: false,
    });
    b.set_kv_dtype(KvDtype::Int8).unwrap();
    b
}

fn spec() -> KvSpec {
    KvSpec {
        n_layers: 3,
        num_blocks: 5,
        block_size: 4,
        n_kv_heads: 2,
        head_dim: 8,
    }
}

/// Writes distinct K/V rows into every slot of every layer through `kv_write`.
fn fill_pool(b: &mut CpuBackend) {
    let s = spec();
    let g = npu_backend::AttnGeometry {
        n_heads: 4,
        n_kv_heads: s.n_kv_heads,
        head_dim: s.head_dim,
        rope: npu_model::Rope {
            style: npu_model::RopeStyle::Halves,
            dims: s.head_dim,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 1.0,
        window: None,
    };
    let slots = (s.num_blocks * s.block_size) as u32;
    let w = g.kv_width();
    b.begin_step(&npu_backend::StepInputs {
        slot_mapping: (0..slots).collect(),
        tokens: vec![0; slots as usize],
        positions: (0..slots).collect(),
        ..Default::default()
    })
    .unwrap();
    for layer in 0..s.n_layers {
        let vals: Vec<f32> = (0..slots as usize * w)
            .map(|i| ((i * 37 + layer * 11) % 101) as f32 * 0.25 - 12.0)
            .collect();
        let mut k = b.alloc(DType::F32, vals.len()).unwrap();
        let mut v = b.alloc(DType::F32, vals.len()).unwrap();
        let rows = slots as usize;
        b.upload(
            HostSlice::F32(&vals),
            ViewMut::rows(&mut k, rows, w).unwrap(),
        )
        .unwrap();
        let neg: Vec<f32> = vals.iter().map(|x| -2.0 * x).collect();
        b.upload(
            HostSlice::F32(&neg),
            ViewMut::rows(&mut v, rows, w).unwrap(),
        )
        .unwrap();
        let (k, v) = (
            View::rows(&k, rows, w).unwrap(),
            View::rows(&v, rows, w).unwrap(),
        );
        b.kv_write(k, v, &g, layer).unwrap();
    }
}

fn blocks_on_host(b: &mut CpuBackend, ids: &[u32]) -> Vec<Vec<u8>> {
    let bb = b.kv_block_bytes();
    let mut host = vec![0u8; ids.len() * bb];
    b.kv_blocks_to_host(ids, &mut host).unwrap();
    host.chunks(bb).map(<[u8]>::to_vec).collect()
}

/// A block: one byte per value and one f16 scale per token, KV head, K or V and layer; the
/// planned size is the allocated one, and a Llama-shaped block (64 or 128 dims a head) holds
/// at least 1.9x the tokens of an f16 one in the same bytes.
#[test]
fn an_int8_block_is_its_values_and_scales() {
    let mut b = backend();
    let s = spec();
    let planned = b.kv_block_bytes_for(&s);
    b.init_kv(s).unwrap();
    let values = s.n_layers * 2 * s.n_kv_heads * s.head_dim * s.block_size;
    let scales = s.n_layers * 2 * s.n_kv_heads * s.block_size * 2;
    assert_eq!(b.kv_block_bytes(), values + scales);
    assert_eq!(planned, b.kv_block_bytes());
    for hd in [64, 128] {
        let llama = KvSpec {
            n_layers: 30,
            num_blocks: 1,
            block_size: 16,
            n_kv_heads: 3,
            head_dim: hd,
        };
        let ratio = llama.f16_block_bytes() as f64 / b.kv_block_bytes_for(&llama) as f64;
        assert!(ratio >= 1.9, "head_dim {hd}: {ratio}");
    }
}

#[test]
fn int8_blocks_copy_whole_with_their_scales() {
    let mut b = backend();
    b.init_kv(spec()).unwrap();
    fill_pool(&mut b);
    let before = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    assert!(before.windows(2).all(|w| w[0] != w[1]), "blocks differ");
    b.kv_copy_blocks(&[(1, 3), (4, 0)]).unwrap();
    let after = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    assert_eq!(after[3], before[1]);
    assert_eq!(after[0], before[4]);
    assert_eq!(after[1..3], before[1..3]);
    let saved = blocks_on_host(&mut b, &[2, 1]);
    b.kv_blocks_from_host(&saved.concat(), &[4, 0]).unwrap();
    assert_eq!(blocks_on_host(&mut b, &[4, 0]), saved);
    // The copies carried the scales: the rows read back are the same values.
    let n = spec().block_size * spec().n_kv_heads * spec().head_dim;
    let (mut k2, mut v2, mut k4, mut v4) =
        (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    b.kv_layer_block_to_host(1, 2, &mut k2, &mut v2).unwrap();
    b.kv_layer_block_to_host(1, 4, &mut k4, &mut v4).unwrap();
    assert_eq!((k2, v2), (k4, v4));
    assert!(b.kv_copy_blocks(&[(5, 0)]).is_err());
    let bb = b.kv_block_bytes();
    assert!(b.kv_blocks_to_host(&[0], &mut vec![0u8; bb - 1]).is_err());
    assert!(b.kv_blocks_from_host(&vec![0u8; bb], &[7]).is_err());
}

/// Long-context mode's per-layer rows: dequantized on the way out (within half a step of what
/// was written), quantized on the way in, touching only that layer of that block.
#[test]
fn int8_layer_blocks_convert_to_and_from_token_rows() {
    let mut b = backend();
    let s = spec();
    b.init_kv(s).unwrap();
    fill_pool(&mut b);
    let w = s.n_kv_heads * s.head_dim;
    let n = s.block_size * w;
    let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
    b.kv_layer_block_to_host(1, 2, &mut k, &mut v).unwrap();
    for t in 0..s.block_size {
        for i in 0..w {
            let x = (((2 * s.block_size + t) * w + i) * 37 + 11) % 101;
            let want = x as f32 * 0.25 - 12.0;
            // A row's values span at most ±25 (K) and ±50 (V): steps of 25/127 and 50/127.
            assert!((k[t * w + i] - want).abs() <= 0.5 * 25.0 / 127.0 * 1.01);
            assert!((v[t * w + i] + 2.0 * want).abs() <= 0.5 * 50.0 / 127.0 * 1.01);
        }
    }
    let before = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    let rows: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
    let neg: Vec<f32> = rows.iter().map(|x| -x).collect();
    b.kv_layer_block_from_host(2, 3, &rows, &neg).unwrap();
    let (mut k2, mut v2) = (vec![0f32; n], vec![0f32; n]);
    b.kv_layer_block_to_host(2, 3, &mut k2, &mut v2).unwrap();
    for i in 0..n {
        assert!((k2[i] - rows[i]).abs() <= 0.5 * 56.5 / 127.0 * 1.01, "{i}");
        assert!((v2[i] - neg[i]).abs() <= 0.5 * 56.5 / 127.0 * 1.01, "{i}");
    }
    // Written back unchanged, the rows give the same bytes (quantizing is idempotent here).
    b.kv_layer_block_from_host(2, 3, &k2, &v2).unwrap();
    let mut again = (vec![0f32; n], vec![0f32; n]);
    b.kv_layer_block_to_host(2, 3, &mut again.0, &mut again.1)
        .unwrap();
    assert_eq!(again, (k2, v2));
    let after = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    assert_eq!(after[..3], before[..3]);
    assert_eq!(after[4], before[4]);
    assert!(b.kv_layer_block_from_host(3, 0, &rows, &neg).is_err());
    assert!(b.kv_layer_block_from_host(0, 0, &rows[1..], &neg).is_err());
}

#[test]
fn the_latent_pool_refuses_int8_by_name() {
    let mut b = backend();
    let s = KvSpec {
        n_kv_heads: 1,
        ..spec()
    };
    let e = b.init_latent_kv(s).unwrap_err().to_string();
    assert!(
        e.contains("kv_cache_dtype int8") && e.contains("latent"),
        "{e}"
    );
    b.set_kv_dtype(KvDtype::F16).unwrap();
    b.init_latent_kv(s).unwrap();
}
