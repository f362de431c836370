//! Damaged model files, one change at a time, through everything that reads a model at load (the
//! `gguf` harness: reader, hyper-parameters, tokenizer, model loader): every header count and
//! length, every metadata value type, every tensor's dimension count, dimensions, type and offset,
//! the alignment, and truncation inside each section. Each must end in an error (naming a key or
//! tensor where the damage is to one), or load, but never panic, and never allocate much more
//! than the file holds: a counting allocator measures the peak of each load.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use npu_gguf::writer::{GgufLayout, GgufWriter, TensorSpec};
use npu_gguf::GgufFile;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The seed rewritten by the writer, so that every field's place is known.
fn rebuild(seed: &str) -> (Vec<u8>, GgufLayout, GgufFile) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus/gguf")
        .join(seed);
    let f = GgufFile::open(&path).unwrap();
    let mut w = GgufWriter::new();
    for key in f.keys() {
        if key != "general.alignment" {
            w.add_meta(key.clone(), f.get(key).unwrap().clone());
        }
    }
    w.set_alignment(32);
    for t in f.tensors() {
        w.add_tensor_spec(TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            type_id: t.ty.id(),
            data: f.tensor_data(t).to_vec(),
            offset: None,
        });
    }
    let (bytes, layout) = w.to_bytes_with_layout().unwrap();
    let parsed = GgufFile::from_bytes(seed, &bytes).unwrap();
    (bytes, layout, parsed)
}

struct Outcome {
    panicked: bool,
    error: Option<String>,
    peak: usize,
}

/// The `gguf` harness's reads, with the error of the first that fails.
fn load(bytes: &[u8]) -> Outcome {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let result = std::panic::catch_unwind(|| -> Result<(), String> {
        let file = GgufFile::from_bytes("damaged.gguf", bytes).map_err(|e| e.to_string())?;
        let _ = npu_tokenizer::Tokenizer::from_gguf(&file);
        npu_fuzz::targets::gguf::load_model(&file)
    });
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    match result {
        Ok(r) => Outcome {
            panicked: false,
            error: r.err(),
            peak,
        },
        Err(_) => Outcome {
            panicked: true,
            error: None,
            peak,
        },
    }
}

/// Where each field of an entry lies.
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

struct Case {
    what: String,
    bytes: Vec<u8>,
    /// A name the error should mention (a key or tensor), when the damage is to one.
    names: Option<String>,
}

fn set_u64(b: &[u8], at: usize, v: u64) -> Vec<u8> {
    let mut d = b.to_vec();
    d[at..at + 8].copy_from_slice(&v.to_le_bytes());
    d
}

fn set_u32(b: &[u8], at: usize, v: u32) -> Vec<u8> {
    let mut d = b.to_vec();
    d[at..at + 4].copy_from_slice(&v.to_le_bytes());
    d
}

fn cases(bytes: &[u8], layout: &GgufLayout, file: &GgufFile) -> Vec<Case> {
    let mut out = Vec::new();
    let mut push =
        |what: String, bytes: Vec<u8>, names: Option<String>| out.push(Case { what, bytes, names });
    // Header counts.
    for (at, field) in [(8usize, "tensor count"), (16, "metadata count")] {
        let v = u64_at(bytes, at);
        for new in [0, v + 1, v.saturating_sub(1), 1 << 20, 1 << 40, u64::MAX] {
            push(
                format!("{field} {v} -> {new}"),
                set_u64(bytes, at, new),
                None,
            );
        }
    }
    // Every metadata entry: key length, value type, string lengths, array types and counts.
    for (i, &start) in layout.metadata_entries.iter().enumerate() {
        let start = start as usize;
        let key_len = u64_at(bytes, start) as usize;
        let key = String::from_utf8_lossy(&bytes[start + 8..start + 8 + key_len]).into_owned();
        let ty_at = start + 8 + key_len;
        let val_at = ty_at + 4;
        for new in [key_len as u64 + 1, 1 << 40, u64::MAX] {
            push(
                format!("key #{i} length -> {new}"),
                set_u64(bytes, start, new),
                None,
            );
        }
        let ty = u32::from_le_bytes(bytes[ty_at..ty_at + 4].try_into().unwrap());
        for new in (0..=13u32).chain([99, u32::MAX]).filter(|&t| t != ty) {
            push(
                format!("{key}: type {ty} -> {new}"),
                set_u32(bytes, ty_at, new),
                Some(key.clone()),
            );
        }
        match ty {
            8 => {
                let len = u64_at(bytes, val_at);
                for new in [len + 1, 1 << 31, u64::MAX] {
                    push(
                        format!("{key}: string length {len} -> {new}"),
                        set_u64(bytes, val_at, new),
                        Some(key.clone()),
                    );
                }
            }
            9 => {
                let elem = u32::from_le_bytes(bytes[val_at..val_at + 4].try_into().unwrap());
                for new in [0u32, 4, 8, 9, 10, 99].into_iter().filter(|&t| t != elem) {
                    push(
                        format!("{key}: element type {elem} -> {new}"),
                        set_u32(bytes, val_at, new),
                        Some(key.clone()),
                    );
                }
                let n = u64_at(bytes, val_at + 4);
                for new in [0, 1, n + 1, n.saturating_sub(1), 1 << 32, u64::MAX] {
                    push(
                        format!("{key}: array count {n} -> {new}"),
                        set_u64(bytes, val_at + 4, new),
                        Some(key.clone()),
                    );
                }
            }
            4 | 5 | 10 | 11 => {
                for new in [0u64, 1, 1 << 30, u32::MAX as u64] {
                    let d = if ty == 4 || ty == 5 {
                        set_u32(bytes, val_at, new as u32)
                    } else {
                        set_u64(bytes, val_at, new)
                    };
                    push(format!("{key}: value -> {new}"), d, Some(key.clone()));
                }
            }
            _ => {}
        }
    }
    // Every tensor's entry: name length, dimension count, dimensions, type, offset.
    for (i, &start) in layout.tensor_infos.iter().enumerate() {
        let start = start as usize;
        let name = file.tensors()[i].name.clone();
        let name_len = u64_at(bytes, start) as usize;
        let nd_at = start + 8 + name_len;
        let nd = u32::from_le_bytes(bytes[nd_at..nd_at + 4].try_into().unwrap()) as usize;
        let ty_at = nd_at + 4 + 8 * nd;
        let off_at = ty_at + 4;
        push(
            format!("{name}: name length -> 2^40"),
            set_u64(bytes, start, 1 << 40),
            None,
        );
        for new in [0u32, 5, nd as u32 + 1, u32::MAX] {
            push(
                format!("{name}: {nd} dims -> {new}"),
                set_u32(bytes, nd_at, new),
                Some(name.clone()),
            );
        }
        for d in 0..nd {
            let at = nd_at + 4 + 8 * d;
            let v = u64_at(bytes, at);
            for new in [0, 1, v * 2, v + 32, 1 << 31, 1 << 40, u64::MAX] {
                push(
                    format!("{name}: dim {d} {v} -> {new}"),
                    set_u64(bytes, at, new),
                    Some(name.clone()),
                );
            }
        }
        for new in [
            0u32,
            1,
            2,
            3,
            6,
            7,
            8,
            10,
            11,
            12,
            13,
            14,
            20,
            30,
            39,
            u32::MAX,
        ] {
            push(
                format!("{name}: type -> {new}"),
                set_u32(bytes, ty_at, new),
                Some(name.clone()),
            );
        }
        let off = u64_at(bytes, off_at);
        for new in [off + 1, off + 32, 1 << 40, u64::MAX - 31] {
            push(
                format!("{name}: offset {off} -> {new}"),
                set_u64(bytes, off_at, new),
                Some(name.clone()),
            );
        }
    }
    // Truncation inside every section.
    let mut cuts: Vec<u64> = vec![0, 3, 4, 8, 16, 23, 24];
    cuts.extend(layout.metadata_entries.iter().flat_map(|&s| [s, s + 5]));
    cuts.extend(layout.tensor_infos.iter().flat_map(|&s| [s, s + 9]));
    cuts.extend([
        layout.tensor_infos_end,
        layout.data_start,
        layout.data_start + 1,
    ]);
    cuts.push(bytes.len() as u64 - 1);
    for cut in cuts {
        if (cut as usize) < bytes.len() {
            push(
                format!("truncated at {cut}"),
                bytes[..cut as usize].to_vec(),
                None,
            );
        }
    }
    out
}

fn check_seed(seed: &str) {
    let (bytes, layout, file) = rebuild(seed);
    let clean = load(&bytes);
    assert!(
        clean.error.is_none() && !clean.panicked,
        "{seed} loads: {:?}",
        clean.error
    );
    // Loading the intact file takes its dequantized weights and buffers: damaged files may take
    // no more than that plus the file's own size again.
    let budget = clean.peak + 2 * bytes.len() + (1 << 20);
    let mut failures = Vec::new();
    let all = cases(&bytes, &layout, &file);
    let (mut refused, mut unnamed) = (0, 0);
    for case in &all {
        let o = load(&case.bytes);
        if o.panicked {
            failures.push(format!("{}: panicked", case.what));
            continue;
        }
        if o.peak > budget {
            failures.push(format!(
                "{}: allocated {} bytes at peak (budget {budget})",
                case.what, o.peak
            ));
        }
        if let Some(e) = &o.error {
            refused += 1;
            assert!(!e.is_empty(), "{}: an empty error", case.what);
            if let Some(name) = &case.names {
                if !e.contains(name.as_str()) {
                    unnamed += 1;
                    if std::env::var_os("SHOW_UNNAMED").is_some() {
                        eprintln!("UNNAMED {}: {e}", case.what);
                    }
                }
            }
        }
    }
    eprintln!(
        "{seed}: {} damaged files, {refused} refused ({unnamed} without naming the damaged key or \
         tensor: a damage that shifts the rest of the file is found further on)",
        all.len()
    );
    assert!(failures.is_empty(), "{seed}:\n{}", failures.join("\n"));
}

#[test]
fn damaged_models_end_in_errors_within_their_size() {
    for seed in [
        "synth-llama-f16",
        "synth-qwen3moe-q8_0",
        "synth-gemma3-q8_0",
        "synth-deepseek2-q8_0",
    ] {
        check_seed(seed);
    }
}
