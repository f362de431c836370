//! Model directories written by `writer` and opened by `Shards`: round trips (one file, shards
//! with an index, a lone file path) and every way the directory can disagree with itself.

use serde_json::Value;

use super::{err, Owned, TempDir};
use crate::writer::{write_file, write_model, WriteTensor, INDEX_FILE, SINGLE_FILE};
use crate::{read_json, Dtype, Shards};

fn check_round_trip(shards: &Shards, owned: &Owned) {
    assert_eq!(shards.tensors().len(), owned.0.len());
    let names: Vec<&str> = shards.tensors().iter().map(|t| t.name.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted, "tensors sorted by name");
    let mut total = 0u64;
    for (name, dtype, shape, data) in &owned.0 {
        let t = shards.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(t.dtype, *dtype);
        assert_eq!(&t.shape, shape);
        assert_eq!(shards.data(t), data.as_slice());
        total += data.len() as u64;
    }
    assert_eq!(shards.total_bytes(), total);
    assert!(shards.get("no.such.tensor").is_none());
}

#[test]
fn single_file_round_trip() {
    let dir = TempDir::new("single");
    let owned = Owned::sample();
    write_model(dir.path(), &owned.views(), None).unwrap();
    assert!(dir.path().join(SINGLE_FILE).is_file());
    assert!(!dir.path().join(INDEX_FILE).exists());
    let shards = Shards::open(dir.path()).unwrap();
    check_round_trip(&shards, &owned);
    assert!(shards.tensors().iter().all(|t| t.shard == 0));
    // A limit the model fits in still writes one file.
    write_model(dir.path(), &owned.views(), Some(1 << 20)).unwrap();
    assert!(!dir.path().join(INDEX_FILE).exists());

    // The file itself may be passed.
    let shards = Shards::open(&dir.path().join(SINGLE_FILE)).unwrap();
    check_round_trip(&shards, &owned);
}

#[test]
fn sharded_round_trip_with_index() {
    let dir = TempDir::new("sharded");
    let owned = Owned::sample();
    // Sizes: 256, 128, 128, 32, 15 bytes; a 256-byte limit gives [256], [128 128], [32 15].
    write_model(dir.path(), &owned.views(), Some(256)).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let index = read_json(dir.path(), INDEX_FILE).unwrap().unwrap();
    assert_eq!(index["metadata"]["total_size"], 256 + 128 + 128 + 32 + 15);
    assert_eq!(
        index["weight_map"]["model.norm.weight"],
        "model-00003-of-00003.safetensors"
    );
    let shards = Shards::open(dir.path()).unwrap();
    check_round_trip(&shards, &owned);
    assert_eq!(shards.files().count(), 3);
    assert_eq!(shards.get("model.embed_tokens.weight").unwrap().shard, 0);
    assert_eq!(shards.get("lm_head.weight").unwrap().shard, 2);

    // Writing again as one file removes the shards and the index.
    write_model(dir.path(), &owned.views(), None).unwrap();
    let n = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(n, 1);
}

#[test]
fn release_keeps_the_bytes_readable() {
    let dir = TempDir::new("release");
    let big: Vec<u8> = (0..3 * 65536 + 17).map(|i| (i % 251) as u8).collect();
    let small = [1u8, 2, 3];
    let ts = [
        WriteTensor {
            name: "small",
            dtype: Dtype::U8,
            shape: &[3],
            data: &small,
        },
        WriteTensor {
            name: "big",
            dtype: Dtype::U8,
            shape: &[big.len()],
            data: &big,
        },
    ];
    write_model(dir.path(), &ts, None).unwrap();
    let shards = Shards::open(dir.path()).unwrap();
    for t in shards.tensors() {
        let before = shards.data(t).to_vec();
        shards.release(t);
        assert_eq!(shards.data(t), before.as_slice());
    }
    assert_eq!(shards.data(shards.get("big").unwrap()), big.as_slice());
    // A TensorMeta from elsewhere reads as empty and releases nothing.
    let mut foreign = shards.get("big").unwrap().clone();
    foreign.shard = 7;
    assert!(shards.data(&foreign).is_empty());
    shards.release(&foreign);
}

#[test]
fn no_weights_says_what_was_looked_for() {
    let dir = TempDir::new("none");
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("looked for model.safetensors and model.safetensors.index.json"),
        "{e}"
    );
    assert!(e.contains("has no *.safetensors file"), "{e}");
    std::fs::write(dir.path().join("weights.safetensors"), b"x").unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"x").unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(e.contains("pytorch_model.bin, weights.safetensors"), "{e}");
    let e = err(Shards::open(&dir.path().join("absent")));
    assert!(e.contains("opening model directory"), "{e}");
}

#[test]
fn damaged_single_file_names_it() {
    let dir = TempDir::new("damaged");
    std::fs::write(dir.path().join(SINGLE_FILE), b"").unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("model.safetensors: the file is 0 bytes long"),
        "{e}"
    );
    let owned = Owned::sample();
    write_file(&dir.path().join(SINGLE_FILE), &owned.views(), &[]).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(SINGLE_FILE))
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 3).unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(e.contains("tensor \"lm_head.weight\""), "{e}");
}

/// A sharded model in a fresh directory, its index as JSON for editing.
fn sharded() -> (TempDir, Value) {
    let dir = TempDir::new("index");
    let owned = Owned::sample();
    write_model(dir.path(), &owned.views(), Some(256)).unwrap();
    let index = read_json(dir.path(), INDEX_FILE).unwrap().unwrap();
    (dir, index)
}

fn write_index(dir: &TempDir, index: &Value) {
    std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
}

#[test]
fn missing_shard() {
    let (dir, _) = sharded();
    std::fs::remove_file(dir.path().join("model-00002-of-00003.safetensors")).unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("model.safetensors.index.json: shards named in \"weight_map\" are missing"),
        "{e}"
    );
    assert!(e.contains("model-00002-of-00003.safetensors"), "{e}");
}

#[test]
fn tensor_in_index_but_not_in_shard() {
    let (dir, mut index) = sharded();
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors".into();
    write_index(&dir, &index);
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("\"weight_map\" maps tensor \"ghost.weight\" to model-00001-of-00003.safetensors, which does not hold it"),
        "{e}"
    );
}

#[test]
fn tensor_in_shard_missing_from_index() {
    let (dir, mut index) = sharded();
    index["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.norm.weight");
    write_index(&dir, &index);
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("tensor \"model.norm.weight\" of shard model-00003-of-00003.safetensors is missing from \"weight_map\""),
        "{e}"
    );
}

#[test]
fn tensor_mapped_to_the_wrong_shard() {
    let (dir, mut index) = sharded();
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors".into();
    write_index(&dir, &index);
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("tensor \"model.norm.weight\" is in shard model-00003-of-00003.safetensors, but \"weight_map\" maps it to model-00001-of-00003.safetensors"),
        "{e}"
    );
}

#[test]
fn tensor_in_two_shards() {
    let (dir, _) = sharded();
    let data = [0u8; 4];
    let ts = [WriteTensor {
        name: "model.norm.weight",
        dtype: Dtype::F32,
        shape: &[1],
        data: &data,
    }];
    write_file(
        &dir.path().join("model-00001-of-00003.safetensors"),
        &ts,
        &[],
    )
    .unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("tensor \"model.norm.weight\" is in two shards: model-00001-of-00003.safetensors and model-00003-of-00003.safetensors"),
        "{e}"
    );
}

#[test]
fn bad_index_json_names_line_and_column() {
    let (dir, _) = sharded();
    std::fs::write(
        dir.path().join(INDEX_FILE),
        "{\n  \"weight_map\": {\n    \"a\": ,\n  }\n}",
    )
    .unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("model.safetensors.index.json: invalid JSON at line 3, column"),
        "{e}"
    );
    std::fs::write(dir.path().join(INDEX_FILE), r#"{"weight_map": [1]}"#).unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(e.contains("invalid JSON at line 1"), "{e}");
    std::fs::write(dir.path().join(INDEX_FILE), r#"{"metadata": {}}"#).unwrap();
    assert!(err(Shards::open(dir.path())).contains("no \"weight_map\" object"));
}

#[test]
fn index_entries_must_be_file_names_once() {
    let (dir, _) = sharded();
    std::fs::write(
        dir.path().join(INDEX_FILE),
        r#"{"weight_map": {"a": "../model.safetensors"}}"#,
    )
    .unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("which is not a file name in the model directory"),
        "{e}"
    );
    std::fs::write(dir.path().join(INDEX_FILE), r#"{"weight_map": {"a": 3}}"#).unwrap();
    assert!(
        err(Shards::open(dir.path())).contains("maps tensor \"a\" to a number, not a file name")
    );
    std::fs::write(
        dir.path().join(INDEX_FILE),
        r#"{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}"#,
    )
    .unwrap();
    assert!(err(Shards::open(dir.path())).contains("tensor \"a\" appears twice in \"weight_map\""));
    std::fs::write(dir.path().join(INDEX_FILE), r#"{"weight_map": {}}"#).unwrap();
    assert!(err(Shards::open(dir.path())).contains("\"weight_map\" is empty"));
}

#[test]
fn damaged_shard_names_the_shard() {
    let (dir, _) = sharded();
    std::fs::write(
        dir.path().join("model-00002-of-00003.safetensors"),
        [5u8; 12],
    )
    .unwrap();
    let e = err(Shards::open(dir.path()));
    assert!(
        e.contains("model-00002-of-00003.safetensors: header length"),
        "{e}"
    );
}

#[test]
fn read_json_absent_and_bad() {
    let dir = TempDir::new("json");
    assert!(read_json(dir.path(), "config.json").unwrap().is_none());
    std::fs::write(dir.path().join("config.json"), "{\"a\": 1,\n\"b\": }").unwrap();
    let e = err(read_json(dir.path(), "config.json"));
    assert!(
        e.contains("config.json: invalid JSON at line 2, column 6: expected value"),
        "{e}"
    );
    std::fs::write(dir.path().join("config.json"), "{\"a\": 1}").unwrap();
    assert_eq!(
        read_json(dir.path(), "config.json").unwrap().unwrap()["a"],
        1
    );
}

#[test]
fn writer_refuses_what_a_reader_would() {
    let dir = TempDir::new("refuse");
    let d = [0u8; 4];
    let dup = [
        WriteTensor {
            name: "a",
            dtype: Dtype::U8,
            shape: &[4],
            data: &d,
        },
        WriteTensor {
            name: "a",
            dtype: Dtype::U8,
            shape: &[4],
            data: &d,
        },
    ];
    assert!(err(write_model(dir.path(), &dup, None)).contains("tensor \"a\" is given twice"));
    let meta = [WriteTensor {
        name: "__metadata__",
        dtype: Dtype::U8,
        shape: &[4],
        data: &d,
    }];
    assert!(err(write_model(dir.path(), &meta, None)).contains("cannot be named"));
}
