//! Writes the GGUF seeds of `fuzz/corpus/gguf/` (run once; the files are committed):
//! - tiny random-weight models of every family (`synth_model_shaped`: one or two layers, width
//!   32) whose tokenizer is the default
//!   model's, cut to its first 400 tokens and the merges among them: whole files that load;
//! - the default model's header: its metadata (the vocabulary cut the same way) and its whole
//!   tensor table, without the data (so the reader gets as far as the data bounds);
//! - the first KiB of the default model.
//!
//! and the seeds that need the project's own encoders: `agent_link` (every frame kind, a segment
//! image holding a real plan of the scheduler and its answer) and `chat_template` (the templates
//! of the default model and Gemma 3, with a conversation), and the `safetensors` seeds (small
//! files of the Hugging Face writer: every dtype, a scalar, an empty tensor, header metadata).
//!
//! `cargo run --release -p npu-fuzz --example make_seeds` (`-- safetensors` writes only the
//! safetensors seeds, which need no model; `-- agent_link` those and the agent link's)

use std::collections::HashSet;
use std::path::Path;

use npu_gguf::store::resolve_model;
use npu_gguf::synth::{synth_model_shaped, Family, Shape};
use npu_gguf::writer::{GgufWriter, TensorSpec};
use npu_gguf::{GgmlType, GgufFile, MetaValue};

const VOCAB: usize = 300;

/// The default model's metadata with the vocabulary cut to `VOCAB` tokens.
fn cut_metadata(f: &GgufFile, w: &mut GgufWriter) {
    let tokens: Vec<String> = f
        .get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .unwrap()
        .iter()
        .take(VOCAB)
        .map(|s| s.to_string())
        .collect();
    let known: HashSet<&str> = tokens.iter().map(String::as_str).collect();
    for key in f.keys() {
        let v = f.get(key).unwrap().clone();
        let v = match (key.as_str(), &v) {
            (
                "tokenizer.ggml.tokens" | "tokenizer.ggml.token_type" | "tokenizer.ggml.scores",
                MetaValue::Array(a),
            ) => MetaValue::Array(a.iter().take(VOCAB).cloned().collect()),
            ("tokenizer.ggml.merges", MetaValue::Array(a)) => MetaValue::Array(
                a.iter()
                    .filter(|m| {
                        let s = m.as_str().unwrap_or("");
                        let Some((l, r)) = s.split_once(' ') else {
                            return false;
                        };
                        known.contains(l)
                            && known.contains(r)
                            && known.contains(&*format!("{l}{r}"))
                    })
                    .cloned()
                    .collect(),
            ),
            _ => v,
        };
        w.add_meta(key.clone(), v);
    }
}

fn main() {
    safetensors_seeds();
    if std::env::args().nth(1).as_deref() == Some("safetensors") {
        return;
    }
    agent_link_seeds();
    if std::env::args().nth(1).as_deref() == Some("agent_link") {
        return;
    }
    chat_template_seeds();
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/gguf");
    std::fs::create_dir_all(&out).unwrap();
    let path = resolve_model(None).expect("the default model");
    let real = GgufFile::open(&path).unwrap();

    let mut donor = GgufWriter::new();
    cut_metadata(&real, &mut donor);
    let donor_bytes = donor.to_bytes().unwrap();
    let donor = GgufFile::from_bytes("donor.gguf", &donor_bytes).unwrap();
    for family in [
        Family::Llama,
        Family::Llama3,
        Family::Qwen2,
        Family::Qwen3,
        Family::Qwen3Moe,
        Family::Gemma3,
    ] {
        let base = family.shape();
        let shape = Shape {
            hidden: 32,
            layers: if family == Family::Gemma3 { 2 } else { 1 },
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
            ff: 64,
            experts: base.experts.min(4),
            experts_used: base.experts_used.min(2),
            expert_ff: base.expert_ff.min(32),
            ..base
        };
        let ty = if family == Family::Llama {
            GgmlType::F16
        } else {
            GgmlType::Q8_0
        };
        {
            let bytes = synth_model_shaped(family, shape, 7, ty, &donor).unwrap();
            let name = format!("synth-{}-{}", family.name(), ty.name().to_lowercase());
            GgufFile::from_bytes(&name, &bytes).expect("the seed reads");
            std::fs::write(out.join(&name), &bytes).unwrap();
            println!("{name}: {} bytes", bytes.len());
        }
    }
    {
        // deepseek2: latent attention (a low-rank query, latent 32 + rope 16), a dense leading
        // layer, then 4 sigmoid-scored experts in 2 groups with a bias, a scale and a shared one.
        let family = Family::Deepseek2;
        let base = family.shape();
        let shape = Shape {
            hidden: 32,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 48,
            ff: 64,
            experts: 4,
            experts_used: 2,
            expert_ff: 32,
            mla: Some(npu_gguf::synth::SynthMla {
                q_lora_rank: 32,
                kv_lora_rank: 32,
                qk_nope: 32,
                qk_rope: 16,
                v_head_dim: 32,
            }),
            moe_extras: npu_gguf::synth::MoeExtras {
                groups: (2, 1),
                ..base.moe_extras
            },
            ..base
        };
        let bytes = synth_model_shaped(family, shape, 7, GgmlType::Q8_0, &donor).unwrap();
        let name = "synth-deepseek2-q8_0";
        GgufFile::from_bytes(name, &bytes).expect("the seed reads");
        std::fs::write(out.join(name), &bytes).unwrap();
        println!("{name}: {} bytes", bytes.len());
    }

    // The default model's header and tensor table, no data.
    let mut w = GgufWriter::new();
    cut_metadata(&real, &mut w);
    let first = real.tensors().first().map_or(0, |t| t.offset);
    for t in real.tensors() {
        w.add_tensor_spec(TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            type_id: t.ty.id(),
            data: Vec::new(),
            offset: Some(t.offset - first),
        });
    }
    let bytes = w.to_bytes().unwrap();
    std::fs::write(out.join("smollm2-header-and-table"), &bytes).unwrap();
    println!("smollm2-header-and-table: {} bytes", bytes.len());

    let head = std::fs::read(&path).unwrap();
    std::fs::write(out.join("smollm2-first-kib"), &head[..1024]).unwrap();
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

/// Safetensors files as `npu_hf::writer` writes them (the header padded to 8 bytes).
fn safetensors_seeds() {
    use npu_hf::writer::{header_bytes, WriteTensor};
    use npu_hf::Dtype;
    let image = |tensors: &[WriteTensor], meta: &[(&str, &str)]| -> Vec<u8> {
        let header = header_bytes(Path::new("seed"), tensors, meta).unwrap();
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(&header);
        for t in tensors {
            v.extend_from_slice(t.data);
        }
        v
    };
    let f32s: Vec<u8> = [1.0f32, -2.0, 0.5, 3.25]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let bf16s = [0x80u8, 0x3f, 0x00, 0xc0, 0x00, 0x3f];
    let two = [
        WriteTensor {
            name: "model.norm.weight",
            dtype: Dtype::F32,
            shape: &[2, 2],
            data: &f32s,
        },
        WriteTensor {
            name: "lm_head.weight",
            dtype: Dtype::BF16,
            shape: &[3],
            data: &bf16s,
        },
    ];
    write(
        "safetensors",
        "two-tensors",
        &image(&two, &[("format", "pt")]),
    );

    // One tensor of every dtype (two elements each), a scalar and an empty tensor.
    let names: Vec<String> = Dtype::ALL
        .iter()
        .map(|d| format!("t.{}", d.name().to_lowercase()))
        .collect();
    let datas: Vec<Vec<u8>> = Dtype::ALL
        .iter()
        .map(|d| (0..2 * d.size()).map(|i| i as u8).collect())
        .collect();
    let mut all: Vec<WriteTensor> = Dtype::ALL
        .iter()
        .zip(names.iter().zip(&datas))
        .map(|(d, (n, data))| WriteTensor {
            name: n,
            dtype: *d,
            shape: &[2],
            data,
        })
        .collect();
    all.push(WriteTensor {
        name: "scalar",
        dtype: Dtype::F32,
        shape: &[],
        data: &f32s[..4],
    });
    all.push(WriteTensor {
        name: "empty",
        dtype: Dtype::F16,
        shape: &[0, 8],
        data: &[],
    });
    write(
        "safetensors",
        "every-dtype",
        &image(&all, &[("format", "pt"), ("note", "seed")]),
    );
}

fn agent_link_seeds() {
    use npu_protocol::frame::{Frame, Hello, Setup, SleepDone, StepDone, StepStatus};
    use npu_protocol::shm::{encode_image, Region, ShmLayout, PROTOCOL_VERSION};
    use npu_protocol::{SeqFailure, SeqResult, StepResult, StepTiming, TokenLogprob};

    let frames = [
        Frame::Setup(Setup {
            agent_id: 1,
            launch_token: 0x1234_5678_9abc_def0,
            segment_name: "/npu-serving-1-0".into(),
            config_json: r#"{"device":"cpu","num_blocks":16}"#.into(),
        }),
        Frame::Hello(Hello {
            agent_id: 1,
            pid: 4242,
            protocol_version: PROTOCOL_VERSION,
            launch_token: 0x1234_5678_9abc_def0,
            layout_hash: 0xdead_beef,
            segment_name: "/npu-serving-1-0".into(),
            model_facts_json: r#"{"vocab_size":49152}"#.into(),
        }),
        Frame::Welcome,
        Frame::Refuse {
            reason: "wrong secret".into(),
        },
        Frame::StartFailed {
            reason: "no model".into(),
        },
        Frame::Step { step_id: 7 },
        Frame::StepDone(StepDone {
            step_id: 7,
            status: StepStatus::Ok,
            timing: StepTiming {
                forward_us: 10,
                sample_us: 2,
                total_us: 13,
            },
            error: String::new(),
            failed: Vec::new(),
        }),
        Frame::StepDone(StepDone {
            step_id: 8,
            status: StepStatus::Failed,
            timing: StepTiming::default(),
            error: "device lost".into(),
            failed: Vec::new(),
        }),
        Frame::StepDone(StepDone {
            step_id: 9,
            status: StepStatus::Ok,
            timing: StepTiming::default(),
            error: String::new(),
            failed: vec![SeqFailure {
                slot: 2,
                error: "adapter sql: /adapters/sql/adapter_model.safetensors: not found".into(),
            }],
        }),
        Frame::Masks { step_id: 9 },
        Frame::Sleep { level: 2 },
        Frame::SleepDone(SleepDone {
            level: 2,
            bytes: 1 << 30,
            took_us: 1500,
            error: String::new(),
        }),
        Frame::Wake,
        Frame::WakeDone(SleepDone {
            level: 0,
            bytes: 1 << 30,
            took_us: 90_000,
            error: String::new(),
        }),
        Frame::Reset,
        Frame::ResetDone,
        Frame::Shutdown,
        Frame::Ping { nonce: 99 },
        Frame::Pong { nonce: 99 },
    ];
    let mut all = vec![0u8];
    for (i, f) in frames.iter().enumerate() {
        let bytes = f.encode();
        let mut one = vec![0u8];
        one.extend_from_slice(&bytes);
        write("agent_link", &format!("frame-{i:02}-{}", f.kind()), &one);
        all.extend_from_slice(&bytes);
    }
    write("agent_link", "frames-all-kinds", &all);

    let layout = ShmLayout::new(npu_fuzz::targets::agent_link::caps()).unwrap();
    let (_, plan) = npu_fuzz::targets::agent_link::scheduler_with_step();
    let step_id = plan.step_id;
    let result = StepResult {
        step_id,
        seqs: plan
            .seqs
            .iter()
            .filter(|q| q.sample)
            .map(|q| SeqResult {
                slot: q.slot,
                token: TokenLogprob {
                    token: 5,
                    logprob: -0.5,
                },
                top: vec![
                    TokenLogprob {
                        token: 5,
                        logprob: -0.5,
                    },
                    TokenLogprob {
                        token: 9,
                        logprob: -1.5,
                    },
                ],
                extra: Vec::new(),
            })
            .collect(),
        ..StepResult::default()
    };
    let image = encode_image(&layout, &plan, &result).unwrap();
    let at = layout.region(Region::ResultMeta).offset as usize;
    let mut seed = vec![1u8];
    seed.extend_from_slice(&image[at..]);
    write("agent_link", "result-three-sequences", &seed);
    let at = layout.region(Region::PlanMeta).offset as usize;
    let end = layout.region(Region::ResultMeta).offset as usize;
    let mut seed = vec![3u8];
    seed.extend_from_slice(&image[at..end]);
    write("agent_link", "plan-three-prefills", &seed);
    let mut seed = vec![2u8];
    seed.extend_from_slice(&[0; 8]);
    write("agent_link", "header-unchanged", &seed);
}

fn chat_template_seeds() {
    use npu_gguf::store::{ensure_chunked_model, StoreEnv, GEMMA3_270M_Q4_K_M};
    let conversation: &[(&str, &str)] = &[
        ("system", "You are brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Weather?"),
    ];
    let mut messages = vec![1u8];
    for (role, content) in conversation {
        messages.extend_from_slice(role.as_bytes());
        messages.push(0);
        messages.extend_from_slice(content.as_bytes());
        messages.push(0);
    }
    let smollm2 = GgufFile::open(resolve_model(None).unwrap()).unwrap();
    let cache = StoreEnv::from_process().cache_dir().unwrap();
    let gemma = GgufFile::open(ensure_chunked_model(&cache, &GEMMA3_270M_Q4_K_M).unwrap()).unwrap();
    for (name, f) in [("smollm2", &smollm2), ("gemma3", &gemma)] {
        let Some(source) = f.get_str("tokenizer.chat_template") else {
            continue;
        };
        let mut seed = source.as_bytes().to_vec();
        seed.push(0);
        seed.extend_from_slice(&messages);
        write("chat_template", &format!("{name}-template"), &seed);
    }
    // Written here in the styles other families use: header tokens per turn with tools in the
    // system turn (Llama 3 style), and tool calls and a thinking block (Qwen 3 style).
    let header_style = "{{ bos_token }}{% if tools is defined and tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
    let tool_style = "{%- set ns = namespace(last_user=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}<|im_start|>{{ m.role }}\n{%- if m.role == 'assistant' and '</think>' in m.content -%}{{ m.content.split('</think>')[-1].lstrip('\n') }}{%- elif m.tool_calls is defined -%}{%- for c in m.tool_calls -%}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments }}}\n</tool_call>{%- endfor -%}{%- else -%}{{ m.content }}{%- endif -%}<|im_end|>\n{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking -%}<think>\n\n</think>\n\n{%- endif -%}{%- endif -%}";
    for (name, source) in [("header-style", header_style), ("tool-style", tool_style)] {
        let mut seed = source.as_bytes().to_vec();
        seed.push(0);
        seed.extend_from_slice(&messages);
        write("chat_template", &format!("{name}-template"), &seed);
        let mut with_extra = source.as_bytes().to_vec();
        with_extra.push(0);
        with_extra.push(3);
        with_extra.extend_from_slice(&messages[1..]);
        write(
            "chat_template",
            &format!("{name}-template-kwargs"),
            &with_extra,
        );
    }
}
