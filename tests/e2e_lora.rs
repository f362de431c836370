//! End to end: multi-LoRA on the real server with its agent process. A random-weight Llama
//! model (the default model's tokenizer) is served with one adapter listed in the config and a
//! second loaded at run time (`POST /v1/load_lora_adapter`); requests name an adapter (or the
//! base model) in `model`, run interleaved and concurrently, and each gives the greedy tokens of
//! its adapter merged into the weights (`W + scale B A`, served by servers of their own), up to
//! the first near-tie. KV computed under one adapter is never reused for another or for the base
//! model (the prefix-cache hit counter stays put, and the tokens stay each model's), and is
//! reused for the same adapter. Unloading takes the name away (404 naming it); duplicates, bad
//! paths, adapters the model cannot take and the base model's name are refused naming the field.
//! `/v1/models` lists the adapters (parent: the base model, root: their files), `/metrics`
//! counts requests per adapter and shows vLLM's `vllm:lora_requests_info`.

mod e2e_support;

use std::path::{Path, PathBuf};

use e2e_support::*;
use npu_agent::model::lora::merge::merge_into_gguf;
use npu_agent::model::lora::synth::{write_peft, SynthAdapter};
use npu_agent::model::lora::Target;
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};
use serde_json::{json, Value};

/// A step whose top two log-probabilities are closer than this may pick either.
const NEAR_TIE: f64 = 0.05;
const STEPS: usize = 8;
const HITS: &str = "npu_serving_prefix_cache_hit_tokens_total{tier=\"device\"}";

/// The model, two adapters and their merged twins, in a scratch directory.
struct Files {
    base: PathBuf,
    ad1: PathBuf,
    ad2: PathBuf,
    /// An adapter of rank 32 (above the server's max_lora_rank 16).
    wide: PathBuf,
    merged1: PathBuf,
    merged2: PathBuf,
}

fn files() -> Files {
    let dir = std::env::temp_dir().join(format!("npu-lora-files-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let donor_path = npu_gguf::store::resolve_model(None).expect("the default model");
    let donor = GgufFile::open(&donor_path).unwrap();
    let base = dir.join("base.gguf");
    std::fs::write(
        &base,
        synth::synth_model(Family::Llama, 7, GgmlType::F32, &donor).unwrap(),
    )
    .unwrap();
    let cfg = npu_model::Checkpoint::open(&base)
        .unwrap()
        .config()
        .unwrap();
    let spec = |rank, alpha, use_rslora, targets: Vec<Target>, seed, bf16| SynthAdapter {
        rank,
        alpha,
        use_rslora,
        targets,
        seed,
        a_range: 0.3,
        b_range: 0.3,
        bf16,
    };
    let f = Files {
        ad1: dir.join("ad1"),
        ad2: dir.join("ad2"),
        wide: dir.join("wide"),
        merged1: dir.join("merged1.gguf"),
        merged2: dir.join("merged2.gguf"),
        base,
    };
    // Adapter 1: every projection (so the KV differs from the base model's); adapter 2:
    // attention only, rsLoRA, bf16.
    write_peft(
        &f.ad1,
        &cfg,
        &spec(8, 16.0, false, Target::ALL.to_vec(), 11, false),
    )
    .unwrap();
    let attn = vec![Target::Q, Target::K, Target::V, Target::O];
    write_peft(&f.ad2, &cfg, &spec(4, 8.0, true, attn.clone(), 12, true)).unwrap();
    write_peft(&f.wide, &cfg, &spec(32, 32.0, false, attn, 13, false)).unwrap();
    let base_file = GgufFile::open(&f.base).unwrap();
    for (ad, out) in [(&f.ad1, &f.merged1), (&f.ad2, &f.merged2)] {
        let host = npu_model::lora::read_adapter(ad, &cfg, 16).unwrap();
        merge_into_gguf(&base_file, &host, out).unwrap();
    }
    f
}

fn opts(model: &Path, extra: &str) -> ServerOpts {
    ServerOpts {
        npu_serving_extra: format!("  model_file: '{}'\n{extra}", model.display()),
        ..ServerOpts::default()
    }
}

/// Greedy tokens of a prompt of token ids, and each step's top-1/top-2 gap.
#[derive(Debug, Clone, PartialEq)]
struct Greedy {
    tokens: Vec<String>,
    gaps: Vec<f64>,
}

fn complete(server: &Server, model: &str, prompt: &[u32]) -> Result<Greedy, (u16, Value)> {
    complete_n(server, model, prompt, STEPS)
}

fn complete_n(
    server: &Server,
    model: &str,
    prompt: &[u32],
    steps: usize,
) -> Result<Greedy, (u16, Value)> {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": steps,
        "temperature": 0, "logprobs": 2, "ignore_eos": true});
    let (status, v) = server.post_json("/v1/completions", &body);
    if status != 200 {
        return Err((status, v));
    }
    assert_eq!(v["model"], model, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.tokens: {v}"))
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let gaps = lp["top_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.top_logprobs: {v}"))
        .iter()
        .map(|top| {
            let mut l: Vec<f64> = top
                .as_object()
                .unwrap()
                .values()
                .map(|x| x.as_f64().unwrap())
                .collect();
            l.sort_by(|a, b| b.total_cmp(a));
            l[0] - l.get(1).copied().unwrap_or(f64::NEG_INFINITY)
        })
        .collect();
    Ok(Greedy { tokens, gaps })
}

fn greedy(server: &Server, model: &str, prompt: &[u32]) -> Greedy {
    complete(server, model, prompt)
        .unwrap_or_else(|(s, v)| panic!("{model}: {s} {v}; log:\n{}", server.log_tail()))
}

/// Asserts `got` follows `want` up to the first near-tie of either; returns the steps compared.
fn agree(what: &str, got: &Greedy, want: &Greedy) -> usize {
    for i in 0..want.tokens.len() {
        if got.tokens[i] != want.tokens[i] {
            assert!(
                want.gaps[i] < NEAR_TIE || got.gaps[i] < NEAR_TIE,
                "{what}: step {i} gave {:?} where the merged model gives {:?}; {:?} vs {:?}",
                got.tokens[i],
                want.tokens[i],
                got.tokens,
                want.tokens
            );
            return i;
        }
        if got.gaps[i] < NEAR_TIE || want.gaps[i] < NEAR_TIE {
            return i + 1;
        }
    }
    want.tokens.len()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 504, 2116, 314, 4649, 314],
        vec![1, 1073, 7385, 28, 5248],
        vec![1, 36, 9410, 3937, 30, 216, 77, 5],
    ]
}

/// A prompt of three full blocks and a bit (block size 16): its blocks can be cached.
fn long_prompt() -> Vec<u32> {
    (0..52u32).map(|i| 100 + (i * 37) % 3000).collect()
}

fn load(server: &Server, name: &str, path: &Path) -> (u16, String) {
    let body = json!({"lora_name": name, "lora_path": path});
    server.request("POST", "/v1/load_lora_adapter", body.to_string().as_bytes())
}

fn unload(server: &Server, name: &str) -> (u16, String) {
    let body = json!({ "lora_name": name });
    server.request(
        "POST",
        "/v1/unload_lora_adapter",
        body.to_string().as_bytes(),
    )
}

#[test]
fn adapters_per_request_give_their_merged_models_tokens_and_never_share_kv() {
    let _serial = serial();
    let f = files();
    let mut all = prompts();
    all.push(long_prompt());

    // The references: each adapter merged into the weights, on a server of its own.
    let reference = |model: &Path, name: &str| -> Vec<Greedy> {
        let server = Server::start(name, &opts(model, ""));
        all.iter().map(|p| greedy(&server, MODEL, p)).collect()
    };
    let want1 = reference(&f.merged1, "lora-merged1");
    let want2 = reference(&f.merged2, "lora-merged2");

    let extra = format!(
        "  max_loras: 2\n  max_lora_rank: 16\n  lora_adapters:\n    - name: ad1\n      \
         path: '{}'\n",
        f.ad1.display()
    );
    let server = Server::start("lora", &opts(&f.base, &extra));
    // The base model first, with nothing else in the cache.
    let base: Vec<Greedy> = all.iter().map(|p| greedy(&server, MODEL, p)).collect();
    for (i, (b, w)) in base.iter().zip(&want1).enumerate() {
        assert_ne!(b.tokens, w.tokens, "prompt {i}: adapter 1 changes nothing");
    }

    // Adapter 2 is loaded at run time; /v1/models lists both with their parent and files.
    let (status, text) = load(&server, "ad2", &f.ad2);
    assert_eq!(status, 200, "{text}; log:\n{}", server.log_tail());
    assert_eq!(text, "Success: LoRA adapter 'ad2' added successfully.");
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL, "ad1", "ad2"], "{models}");
    for (m, dir) in models["data"].as_array().unwrap()[1..]
        .iter()
        .zip([&f.ad1, &f.ad2])
    {
        assert_eq!(m["parent"], MODEL, "{m}");
        let root = std::fs::canonicalize(dir).unwrap();
        assert_eq!(m["root"], root.to_str().unwrap(), "{m}");
    }

    // Prefix cache: the long prompt's blocks, cached under the base model above, are not
    // reused by either adapter (the hit counter stays put, the tokens are the merged models'),
    // nor adapter 1's by adapter 2; each reuses its own on the second time.
    let long = all.len() - 1;
    let hits = server.metric(HITS);
    let a1 = greedy(&server, "ad1", &all[long]);
    let a2 = greedy(&server, "ad2", &all[long]);
    assert_eq!(server.metric(HITS), hits, "KV reused across adapters");
    agree("long prompt on ad1 after the base model", &a1, &want1[long]);
    agree("long prompt on ad2 after ad1", &a2, &want2[long]);
    assert_eq!(greedy(&server, "ad1", &all[long]), a1);
    let after_repeat = server.metric(HITS);
    assert!(
        after_repeat >= hits + 48.0,
        "ad1 did not reuse its own 3 blocks: {hits} -> {after_repeat}"
    );
    assert_eq!(greedy(&server, MODEL, &all[long]), base[long]);
    assert!(server.metric(HITS) >= after_repeat + 48.0);

    // Interleaved and concurrent: every prompt on the base model and both adapters at once.
    let jobs: Vec<(usize, &str)> = (0..3)
        .flat_map(|i| [(i, "ad2"), (i, MODEL), (i, "ad1")])
        .collect();
    let got: Vec<Greedy> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(i, m)| {
                let (server, p) = (&server, &all[i]);
                s.spawn(move || greedy(server, m, p))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut compared = 0;
    for ((i, m), g) in jobs.iter().zip(&got) {
        let want = match *m {
            "ad1" => &want1[*i],
            "ad2" => &want2[*i],
            _ => &base[*i],
        };
        let n = agree(&format!("prompt {i} on {m}"), g, want);
        eprintln!(
            "prompt {i} on {m}: {n} of {STEPS} steps compared, {:?}",
            g.tokens
        );
        compared += n;
    }
    assert!(
        compared >= 6 * STEPS,
        "only {compared} steps compared before near-ties"
    );

    // Chat completions run the adapter too (its name comes back as `model`).
    let body = json!({"model": "ad1", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4, "temperature": 0});
    let (status, v) = server.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "ad1");
    let body = json!({"model": "ad1", "input": "Hi", "max_output_tokens": 4, "temperature": 0});
    let (status, v) = server.post_json("/v1/responses", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "ad1");

    // Refusals, each naming its problem.
    for (name, path, status, needle) in [
        ("ad1", f.ad1.clone(), 400, "already been loaded"),
        (MODEL, f.ad2.clone(), 400, "base model"),
        ("nope", f.ad1.join("missing"), 400, "lora_path"),
        ("wide", f.wide.clone(), 400, "rank"),
    ] {
        let (s, text) = load(&server, name, &path);
        assert_eq!(s, status, "{name}: {text}");
        assert!(text.contains(needle), "{name}: {text}");
    }
    let (s, text) = unload(&server, "nope");
    assert_eq!(s, 404, "{text}");
    assert!(text.contains("nope"), "{text}");

    // Unloading takes the name away from new requests.
    let (s, text) = unload(&server, "ad2");
    assert_eq!(
        (s, text.as_str()),
        (200, "Success: LoRA adapter 'ad2' removed successfully.")
    );
    let (s, v) = complete(&server, "ad2", &all[0]).unwrap_err();
    assert_eq!(s, 404, "{v}");
    assert!(v.to_string().contains("ad2"), "{v}");
    // Loaded again under another name, it is read again and runs as before.
    let (s, text) = load(&server, "ad2-again", &f.ad2);
    assert_eq!(s, 200, "{text}");
    agree(
        "ad2-again",
        &greedy(&server, "ad2-again", &all[0]),
        &want2[0],
    );

    // Unloading an adapter a request is running on: the request finishes on it (vLLM lets the
    // unload proceed; nothing running is lost).
    std::thread::scope(|s| {
        let running = s.spawn(|| complete_n(&server, "ad2-again", &all[0], 256));
        let seen = (0..500).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            server
                .get("/metrics")
                .1
                .contains("running_lora_adapters=\"ad2-again\"")
        });
        assert!(seen, "the long request was never seen running");
        let (st, text) = unload(&server, "ad2-again");
        assert_eq!(st, 200, "{text}");
        let got = running.join().unwrap().unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(got.tokens.len(), 256);
        agree("ad2-again across its unload", &got, &want2[0]);
    });

    // A sleep that drops the model: on wake the agent loads it again with its adapter slots,
    // and reads the adapter again when a request names it.
    let (st, v) = server.post_json("/sleep", &json!({"level": 2}));
    assert_eq!(st, 200, "{v}");
    agree(
        "ad1 after a level-2 sleep",
        &greedy(&server, "ad1", &all[1]),
        &want1[1],
    );

    // Metrics: requests per adapter, vLLM's adapter gauge.
    let text = server.get("/metrics").1;
    assert!(
        server.metric("npu_serving_lora_requests_total{adapter=\"ad1\"}") >= 5.0,
        "{text}"
    );
    assert!(
        text.contains("vllm:lora_requests_info{max_lora=\"2\""),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(f.base.parent().unwrap());
}

#[test]
fn with_one_adapter_slot_requests_on_other_adapters_wait_and_lose_nothing() {
    let _serial = serial();
    let f = files();
    let extra = format!(
        "  max_loras: 1\n  lora_adapters:\n    - {{name: ad1, path: '{}'}}\n    \
         - {{name: ad2, path: '{}'}}\n",
        f.ad1.display(),
        f.ad2.display()
    );
    let server = Server::start("lora-one-slot", &opts(&f.base, &extra));
    let p = prompts();
    // Each alone first (one adapter at a time: nothing waits).
    let alone: Vec<Greedy> = ["ad1", "ad2"]
        .iter()
        .map(|m| greedy(&server, m, &p[0]))
        .collect();
    assert_ne!(alone[0].tokens, alone[1].tokens);
    // Then interleaved and all at once: one adapter runs at a time, the other waits its turn
    // (first come, first served), the base model runs beside either.
    let jobs = ["ad1", "ad2", MODEL, "ad1", "ad2", "ad1"];
    let done = std::sync::atomic::AtomicBool::new(false);
    let (got, waited): (Vec<Greedy>, bool) = std::thread::scope(|s| {
        // Watches vLLM's gauge for an adapter waiting while the other runs.
        let watch = s.spawn(|| {
            let mut waited = false;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let text = server.get("/metrics").1;
                waited |= text.contains("running_lora_adapters=\"ad")
                    && text.contains("waiting_lora_adapters=\"ad");
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            waited
        });
        let handles: Vec<_> = jobs
            .iter()
            .map(|&m| {
                let (server, p) = (&server, &p[0]);
                s.spawn(move || greedy(server, m, p))
            })
            .collect();
        let got = handles.into_iter().map(|h| h.join().unwrap()).collect();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (got, watch.join().unwrap())
    });
    assert!(waited, "no request was seen waiting for the adapter slot");
    for (m, g) in jobs.iter().zip(&got) {
        match *m {
            "ad1" => assert_eq!(g, &alone[0]),
            "ad2" => assert_eq!(g, &alone[1]),
            _ => assert_ne!(g.tokens, alone[0].tokens),
        }
    }
    let _ = std::fs::remove_dir_all(f.base.parent().unwrap());
}

#[test]
fn an_unknown_adapter_is_404_and_a_server_without_lora_refuses_loads() {
    let _serial = serial();
    let server = Server::start("lora-off", &ServerOpts::default());
    let body = json!({"model": "sql-adapter", "prompt": "Hi", "max_tokens": 2});
    let (s, v) = server.post_json("/v1/completions", &body);
    assert_eq!(s, 404, "{v}");
    assert!(v.to_string().contains("sql-adapter"), "{v}");
    let (s, text) = load(&server, "sql", Path::new("/tmp"));
    assert_eq!(s, 400, "{text}");
    assert!(text.contains("max_loras"), "{text}");
}

#[test]
fn a_listed_adapter_that_cannot_be_read_stops_the_start_naming_its_entry() {
    let _serial = serial();
    let yaml = ServerOpts {
        npu_serving_extra: "  lora_adapters:\n    - {name: ok, path: /}\n".into(),
        ..ServerOpts::default()
    }
    .yaml();
    let (status, err) = serve_refused("lora-bad-entry", &yaml, &[]);
    assert!(!status.success());
    assert!(err.contains("npu_serving.lora_adapters[0]"), "{err}");
    assert!(err.contains("lora_path"), "{err}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// An adapter whose files are deleted or garbled after it was loaded fails only the requests
/// that name it, each with an error naming the adapter and its path (the whole response, or
/// an error event in a stream), while the base model's and another adapter's requests in the
/// same steps go on to their tokens, and no agent restarts. The adapter is then out of service:
/// requests naming it get a 400 at once, `/v1/models` leaves it out, and loading it again under
/// its name (its files fixed) brings it back.
#[test]
fn an_adapter_whose_files_break_after_loading_fails_only_its_own_requests() {
    let _serial = serial();
    let f = files();
    let dir = f.base.parent().unwrap().to_path_buf();
    let (gone, garbled) = (dir.join("gone"), dir.join("garbled"));
    copy_dir(&f.ad2, &gone);
    copy_dir(&f.ad2, &garbled);
    let extra = format!(
        "  max_loras: 3\n  max_lora_rank: 16\n  lora_adapters:\n    - {{name: ad1, path: '{}'}}\n    \
         - {{name: ad2, path: '{}'}}\n",
        f.ad1.display(),
        f.ad2.display()
    );
    let server = Server::start("lora-broken", &opts(&f.base, &extra));
    const LONG: usize = 128;
    let p = prompts();
    let alone = |m: &str, steps| {
        complete_n(&server, m, &p[0], steps).unwrap_or_else(|e| panic!("{m}: {e:?}"))
    };
    let (base_alone, ad1_alone, ad2_alone) =
        (alone(MODEL, LONG), alone("ad1", LONG), alone("ad2", STEPS));
    for (name, path) in [("gone", &gone), ("garbled", &garbled)] {
        let (s, text) = load(&server, name, path);
        assert_eq!(s, 200, "{name}: {text}");
    }
    // Broken after the server checked them: one deleted, one's weights overwritten.
    let gone_path = std::fs::canonicalize(&gone).unwrap();
    let garbled_path = std::fs::canonicalize(&garbled).unwrap();
    std::fs::remove_dir_all(&gone).unwrap();
    let weights = std::fs::read_dir(&garbled)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("the adapter's safetensors file");
    std::fs::write(&weights, b"not a safetensors file at all").unwrap();
    let restarts = server.metric("npu_serving_agent_restarts_total");

    let (server, p) = (&server, &p);
    let (base, ad1, broken) = std::thread::scope(|s| {
        let base = s.spawn(move || complete_n(server, MODEL, &p[0], LONG));
        let ad1 = s.spawn(move || complete_n(server, "ad1", &p[0], LONG));
        let running = (0..1000).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            let m = server.get("/metrics").1;
            m.contains("running_lora_adapters=\"ad1\"")
                && server.metric("npu_serving_requests_running") >= 2.0
        });
        assert!(
            running,
            "the base and ad1 requests were never seen running together"
        );
        // Admitted into steps that carry the two running requests.
        let gone = s.spawn(move || complete_n(server, "gone", &p[1], STEPS));
        let body = json!({"model": "garbled", "prompt": p[2], "max_tokens": STEPS,
            "temperature": 0, "stream": true});
        let garbled =
            s.spawn(move || server.request("POST", "/v1/completions", body.to_string().as_bytes()));
        let broken = (gone.join().unwrap(), garbled.join().unwrap());
        (base.join().unwrap(), ad1.join().unwrap(), broken)
    });
    let log = server.log_tail();
    // The others got their tokens, exactly as alone.
    let base = base.unwrap_or_else(|e| panic!("the base model's request failed: {e:?}; {log}"));
    let ad1 = ad1.unwrap_or_else(|e| panic!("ad1's request failed: {e:?}; {log}"));
    assert_eq!(base, base_alone);
    assert_eq!(ad1, ad1_alone);
    // The broken ones failed naming their adapter, its path and what was wrong.
    let (status, v) = broken
        .0
        .expect_err("a request on a deleted adapter succeeded");
    let msg = v.to_string();
    assert_eq!(status, 500, "{msg}");
    assert!(msg.contains("'gone'"), "{msg}");
    assert!(msg.contains(gone_path.to_str().unwrap()), "{msg}");
    let (status, text) = broken.1;
    assert_eq!(status, 200, "a stream starts before its error: {text}");
    assert!(text.contains("\"error\""), "{text}");
    assert!(text.contains("'garbled'"), "{text}");
    assert!(text.contains(garbled_path.to_str().unwrap()), "{text}");
    assert!(text.contains("cannot be read"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(
        server.metric("npu_serving_agent_restarts_total"),
        restarts,
        "an agent restarted"
    );

    // Out of service now: refused at once naming the adapter, left out of /v1/models.
    let (s, v) = complete(server, "gone", &p[0]).unwrap_err();
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("'gone' is out of service"), "{v}");
    let models = server.get("/v1/models").1;
    assert!(
        !models.contains("gone") && !models.contains("garbled"),
        "{models}"
    );
    assert!(models.contains("ad1"), "{models}");
    assert_eq!(server.metric("npu_serving_lora_adapters"), 2.0);
    // Loaded again under its name from good files, it runs.
    let (s, text) = load(server, "gone", &f.ad2);
    assert_eq!(s, 200, "{text}");
    assert_eq!(greedy(server, "gone", &p[0]), ad2_alone);
    let _ = std::fs::remove_dir_all(&dir);
}
