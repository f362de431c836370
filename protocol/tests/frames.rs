//! Control frames: every kind round trips; truncated frames wait or fail cleanly; garbage,
//! bad lengths, unknown types and trailing bytes are errors, never panics.

use std::io::Cursor;

use npu_protocol::frame::{
    read_frame, write_frame, Fill, Frame, FrameError, FrameReader, Hello, Setup, SleepDone,
    StepDone, StepStatus, MAX_FRAME_LEN,
};
use npu_protocol::{SeqFailure, StepTiming, MAX_SEQ_FAILURE};
use proptest::prelude::*;

fn every_kind() -> Vec<Frame> {
    vec![
        Frame::Setup(Setup {
            agent_id: 3,
            launch_token: u128::MAX - 7,
            segment_name: "/npu-serving-1-3-00ff".into(),
            config_json: r#"{"model_path":"/m.gguf","num_blocks":64}"#.into(),
        }),
        Frame::Hello(Hello {
            agent_id: 3,
            pid: 4242,
            protocol_version: 1,
            launch_token: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            layout_hash: 0xdead_beef_0123_4567,
            segment_name: "/npu-serving-1-3-00ff".into(),
            model_facts_json: r#"{"name":"SmolLM2","vocab_size":49152}"#.into(),
        }),
        Frame::Welcome,
        Frame::Refuse {
            reason: "layout hash differs".into(),
        },
        Frame::StartFailed {
            reason: "engine: no such file — ü".into(),
        },
        Frame::Step { step_id: u64::MAX },
        Frame::Masks { step_id: 41 },
        Frame::StepDone(StepDone {
            step_id: 9,
            status: StepStatus::Ok,
            timing: StepTiming {
                forward_us: 1,
                sample_us: 2,
                total_us: 3,
            },
            error: String::new(),
            failed: vec![SeqFailure {
                slot: 4,
                error: "LoRA adapter 2 (/a/b): no adapter_config.json".into(),
            }],
        }),
        Frame::StepDone(StepDone {
            step_id: 10,
            status: StepStatus::Failed,
            timing: StepTiming::default(),
            error: "bad step plan: slot 3 was never admitted".into(),
            failed: Vec::new(),
        }),
        Frame::Reset,
        Frame::ResetDone,
        Frame::Shutdown,
        Frame::Ping { nonce: 7 },
        Frame::Pong { nonce: 7 },
        Frame::Sleep { level: 2 },
        Frame::SleepDone(SleepDone {
            level: 1,
            bytes: 12 << 20,
            took_us: 345,
            error: String::new(),
        }),
        Frame::Wake,
        Frame::WakeDone(SleepDone {
            level: 2,
            bytes: 0,
            took_us: 9,
            error: "engine: the model file is gone".into(),
        }),
    ]
}

#[test]
fn every_kind_round_trips_through_decode_and_read_frame() {
    let mut stream = Vec::new();
    for frame in every_kind() {
        let bytes = frame.encode();
        let (back, used) = Frame::decode(&bytes).unwrap().unwrap();
        assert_eq!(back, frame);
        assert_eq!(used, bytes.len());
        write_frame(&mut stream, &frame).unwrap();
    }
    let mut cursor = Cursor::new(stream);
    for frame in every_kind() {
        assert_eq!(read_frame(&mut cursor).unwrap(), frame);
    }
    assert!(matches!(read_frame(&mut cursor), Err(FrameError::Closed)));
}

#[test]
fn every_prefix_of_a_frame_is_incomplete_not_an_error() {
    for frame in every_kind() {
        let bytes = frame.encode();
        for cut in 0..bytes.len() {
            assert!(
                Frame::decode(&bytes[..cut]).unwrap().is_none(),
                "{} cut at {cut}",
                frame.kind()
            );
            if cut > 0 {
                let err = read_frame(&mut Cursor::new(&bytes[..cut])).unwrap_err();
                assert!(matches!(err, FrameError::ClosedMidFrame), "{err:?}");
            }
        }
    }
}

#[test]
fn a_payload_shorter_than_its_kind_needs_is_truncated() {
    // A Step frame whose length says 5: the type byte and 4 of the 8 step_id bytes.
    let bytes = [5, 0, 0, 0, 10, 1, 2, 3, 4];
    assert!(matches!(
        Frame::decode(&bytes),
        Err(FrameError::Truncated { kind: "Step", .. })
    ));
    // A Refuse whose text length points past the payload.
    let bytes = [5, 0, 0, 0, 3, 200, 0, 0, 0];
    assert!(matches!(
        Frame::decode(&bytes),
        Err(FrameError::Truncated { kind: "Refuse", .. })
    ));
}

#[test]
fn bad_lengths_types_statuses_and_trailing_bytes_are_errors() {
    assert!(matches!(
        Frame::decode(&[0, 0, 0, 0, 2]),
        Err(FrameError::BadLength(0))
    ));
    let too_long = ((MAX_FRAME_LEN + 1) as u32).to_le_bytes();
    assert!(matches!(
        Frame::decode(&too_long),
        Err(FrameError::BadLength(_))
    ));
    assert!(matches!(
        read_frame(&mut Cursor::new(u32::MAX.to_le_bytes())),
        Err(FrameError::BadLength(_))
    ));
    assert!(matches!(
        Frame::decode(&[1, 0, 0, 0, 99]),
        Err(FrameError::UnknownType(99))
    ));
    assert!(matches!(
        Frame::decode(&[2, 0, 0, 0, 2, 0]),
        Err(FrameError::TrailingBytes {
            kind: "Welcome",
            extra: 1
        })
    ));
    let mut done = Frame::StepDone(StepDone {
        step_id: 1,
        status: StepStatus::Ok,
        timing: StepTiming::default(),
        error: String::new(),
        failed: Vec::new(),
    })
    .encode();
    done[4 + 1 + 8] = 2;
    assert!(matches!(
        Frame::decode(&done),
        Err(FrameError::BadField {
            kind: "StepDone",
            ..
        })
    ));
    let bad_utf8 = [7, 0, 0, 0, 3, 2, 0, 0, 0, 0xff, 0xfe];
    assert!(matches!(
        Frame::decode(&bad_utf8),
        Err(FrameError::BadField { kind: "Refuse", .. })
    ));
}

#[test]
fn oversized_texts_are_cut_to_fit_a_frame() {
    let frame = Frame::StartFailed {
        reason: "é".repeat(MAX_FRAME_LEN),
    };
    let bytes = frame.encode();
    assert!(bytes.len() - 4 <= MAX_FRAME_LEN);
    let (Frame::StartFailed { reason }, _) = Frame::decode(&bytes).unwrap().unwrap() else {
        panic!("wrong kind");
    };
    assert!(reason.len() > MAX_FRAME_LEN / 2 && reason.chars().all(|c| c == 'é'));

    // A step's sequence failures keep every slot, their reasons cut, and the frame fits.
    let frame = Frame::StepDone(StepDone {
        step_id: 2,
        status: StepStatus::Ok,
        timing: StepTiming::default(),
        error: "x".repeat(MAX_FRAME_LEN),
        failed: (0..2000)
            .map(|slot| SeqFailure {
                slot,
                error: "é".repeat(MAX_SEQ_FAILURE),
            })
            .collect(),
    });
    let bytes = frame.encode();
    assert!(bytes.len() - 4 <= MAX_FRAME_LEN);
    let (Frame::StepDone(d), _) = Frame::decode(&bytes).unwrap().unwrap() else {
        panic!("wrong kind");
    };
    assert_eq!(d.failed.len(), 2000);
    assert!(d.failed.iter().enumerate().all(|(i, f)| f.slot == i as u32));
    assert!(d.failed[0].error.len() <= MAX_SEQ_FAILURE && d.failed[0].error.len() > 1000);

    // A reason longer than an encoder writes is refused (what decodes re-encodes the same).
    let mut payload = vec![11u8]; // StepDone
    payload.extend_from_slice(&[0; 8 + 1 + 24]);
    payload.extend_from_slice(&1u32.to_le_bytes());
    payload.extend_from_slice(&3u32.to_le_bytes());
    payload.extend_from_slice(&(MAX_SEQ_FAILURE as u32 + 1).to_le_bytes());
    payload.extend(std::iter::repeat_n(b'x', MAX_SEQ_FAILURE + 1));
    payload.extend_from_slice(&0u32.to_le_bytes());
    let mut bytes = (payload.len() as u32).to_le_bytes().to_vec();
    bytes.extend_from_slice(&payload);
    let e = Frame::decode(&bytes).unwrap_err().to_string();
    assert!(e.contains("StepDone") && e.contains("slot 3"), "{e}");
}

#[test]
fn frame_reader_assembles_frames_from_single_bytes() {
    let stream: Vec<u8> = every_kind().iter().flat_map(|f| f.encode()).collect();
    let mut reader = FrameReader::new();
    let mut got = Vec::new();
    for b in &stream {
        reader.push(std::slice::from_ref(b));
        while let Some(f) = reader.next_frame().unwrap() {
            got.push(f);
        }
    }
    assert_eq!(got, every_kind());
    assert_eq!(reader.pending(), 0);
}

#[test]
fn frame_reader_fill_reports_reads_and_close() {
    let bytes = Frame::Ping { nonce: 5 }.encode();
    let mut source = Cursor::new(bytes.clone());
    let mut reader = FrameReader::new();
    assert_eq!(reader.fill(&mut source).unwrap(), Fill::Read(bytes.len()));
    assert_eq!(reader.fill(&mut source).unwrap(), Fill::Closed);
    assert_eq!(reader.next_frame().unwrap(), Some(Frame::Ping { nonce: 5 }));
    assert_eq!(reader.next_frame().unwrap(), None);
}

proptest! {
    #[test]
    fn random_hellos_and_step_dones_round_trip(
        agent_id in any::<u32>(), pid in any::<u32>(), version in any::<u32>(),
        hash in any::<u64>(), name in ".{0,40}", facts in ".{0,200}", token in any::<u128>(),
        step_id in any::<u64>(), failed in any::<bool>(), n_seq_failures in 0u32..4,
        times in (any::<u64>(), any::<u64>(), any::<u64>()), error in ".{0,80}",
    ) {
        let hello = Frame::Hello(Hello {
            agent_id, pid, protocol_version: version, launch_token: token, layout_hash: hash,
            segment_name: name.clone(), model_facts_json: facts.clone(),
        });
        let setup = Frame::Setup(Setup {
            agent_id, launch_token: token, segment_name: name, config_json: facts,
        });
        let done = Frame::StepDone(StepDone {
            step_id,
            status: if failed { StepStatus::Failed } else { StepStatus::Ok },
            timing: StepTiming { forward_us: times.0, sample_us: times.1, total_us: times.2 },
            error,
            failed: (0..n_seq_failures)
                .map(|i| SeqFailure { slot: i, error: format!("slot {i} failed") })
                .collect(),
        });
        for frame in [hello, setup, done] {
            let bytes = frame.encode();
            prop_assert_eq!(Frame::decode(&bytes).unwrap(), Some((frame, bytes.len())));
        }
    }

    #[test]
    fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Frame::decode(&bytes);
        let _ = read_frame(&mut Cursor::new(&bytes));
        let mut reader = FrameReader::new();
        reader.push(&bytes);
        while let Ok(Some(_)) = reader.next_frame() {}
    }

    #[test]
    fn garbage_with_a_plausible_header_never_panics(
        tag in any::<u8>(), payload in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = ((payload.len() + 1) as u32).to_le_bytes().to_vec();
        bytes.push(tag);
        bytes.extend_from_slice(&payload);
        if let Ok(Some((frame, used))) = Frame::decode(&bytes) {
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(frame.encode(), bytes);
        }
    }
}
