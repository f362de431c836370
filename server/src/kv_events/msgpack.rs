//! The few MessagePack forms a KV event batch needs (nil, unsigned and float numbers, strings,
//! arrays), and the batch itself in the array layout vLLM's publisher writes (msgspec structs
//! with `array_like` and a leading tag), so that subscribers written for vLLM read it as is:
//!
//! - batch: `[ts, [event...], data_parallel_rank]`
//! - `["BlockStored", [hash], parent_hash | nil, [token...], block_size, lora_id | nil, medium]`
//! - `["BlockRemoved", [hash], medium]`
//! - `["AllBlocksCleared"]`
//!
//! Hashes are the low 64 bits of the prefix cache's chained 128-bit block hashes; the medium is
//! `"GPU"` for the device pool (vLLM's name for it, whatever the device) and `"CPU"` for the
//! host tier.

use npu_scheduler::{KvEvent, KvMedium};

/// Appends MessagePack values to a buffer.
#[derive(Debug, Default)]
pub struct Encoder {
    pub out: Vec<u8>,
}

impl Encoder {
    pub fn nil(&mut self) {
        self.out.push(0xc0);
    }

    pub fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.out.push(v as u8),
            0x80..=0xff => self.out.extend([0xcc, v as u8]),
            0x100..=0xffff => {
                self.out.push(0xcd);
                self.out.extend((v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.out.push(0xce);
                self.out.extend((v as u32).to_be_bytes());
            }
            _ => {
                self.out.push(0xcf);
                self.out.extend(v.to_be_bytes());
            }
        }
    }

    pub fn float(&mut self, v: f64) {
        self.out.push(0xcb);
        self.out.extend(v.to_be_bytes());
    }

    pub fn str(&mut self, s: &str) {
        let n = s.len();
        match n {
            0..=31 => self.out.push(0xa0 | n as u8),
            32..=0xff => self.out.extend([0xd9, n as u8]),
            0x100..=0xffff => {
                self.out.push(0xda);
                self.out.extend((n as u16).to_be_bytes());
            }
            _ => {
                self.out.push(0xdb);
                self.out.extend((n as u32).to_be_bytes());
            }
        }
        self.out.extend(s.as_bytes());
    }

    pub fn array(&mut self, n: usize) {
        match n {
            0..=15 => self.out.push(0x90 | n as u8),
            16..=0xffff => {
                self.out.push(0xdc);
                self.out.extend((n as u16).to_be_bytes());
            }
            _ => {
                self.out.push(0xdd);
                self.out.extend((n as u32).to_be_bytes());
            }
        }
    }
}

/// The 64-bit hash a subscriber sees for a block.
pub fn external_hash(hash: u128) -> u64 {
    hash as u64
}

fn medium_name(m: KvMedium) -> &'static str {
    match m {
        KvMedium::Device => "GPU",
        KvMedium::Host => "CPU",
    }
}

/// One batch: the events of one agent (its index is the data-parallel rank) taken at `ts`
/// (seconds since the Unix epoch).
pub fn encode_batch(ts: f64, events: &[KvEvent], rank: u32, block_size: u32) -> Vec<u8> {
    let mut e = Encoder::default();
    e.array(3);
    e.float(ts);
    e.array(events.len());
    for event in events {
        match event {
            KvEvent::Stored {
                hash,
                parent,
                tokens,
                lora,
                medium,
            } => {
                e.array(7);
                e.str("BlockStored");
                e.array(1);
                e.uint(external_hash(*hash));
                match parent {
                    Some(p) => e.uint(external_hash(*p)),
                    None => e.nil(),
                }
                e.array(tokens.len());
                for &t in tokens.iter() {
                    e.uint(u64::from(t));
                }
                e.uint(u64::from(block_size));
                // The LoRA adapter's id the KV was computed under (nil: the base model).
                match lora {
                    0 => e.nil(),
                    l => e.uint(u64::from(*l)),
                }
                e.str(medium_name(*medium));
            }
            KvEvent::Removed { hash, medium } => {
                e.array(3);
                e.str("BlockRemoved");
                e.array(1);
                e.uint(external_hash(*hash));
                e.str(medium_name(*medium));
            }
            KvEvent::AllCleared => {
                e.array(1);
                e.str("AllBlocksCleared");
            }
        }
    }
    e.uint(u64::from(rank));
    e.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(f: impl FnOnce(&mut Encoder)) -> Vec<u8> {
        let mut e = Encoder::default();
        f(&mut e);
        e.out
    }

    #[test]
    fn each_form_takes_its_shortest_encoding() {
        assert_eq!(enc(|e| e.uint(5)), [0x05]);
        assert_eq!(enc(|e| e.uint(200)), [0xcc, 200]);
        assert_eq!(enc(|e| e.uint(0x1234)), [0xcd, 0x12, 0x34]);
        assert_eq!(enc(|e| e.uint(0x1_0000)), [0xce, 0, 1, 0, 0]);
        assert_eq!(
            enc(|e| e.uint(u64::MAX)),
            [0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]
        );
        assert_eq!(enc(|e| e.str("GPU")), [0xa3, b'G', b'P', b'U']);
        let long = "x".repeat(40);
        assert_eq!(&enc(|e| e.str(&long))[..2], &[0xd9, 40]);
        assert_eq!(enc(|e| e.array(2)), [0x92]);
        assert_eq!(enc(|e| e.array(300)), [0xdc, 0x01, 0x2c]);
        assert_eq!(enc(|e| e.float(1.5))[0], 0xcb);
        assert_eq!(enc(|e| e.nil()), [0xc0]);
    }

    #[test]
    fn a_batch_has_vllms_array_layout() {
        let events = [
            KvEvent::Stored {
                hash: (7u128 << 64) | 42,
                parent: None,
                tokens: vec![1, 300].into(),
                lora: 0,
                medium: KvMedium::Device,
            },
            KvEvent::Removed {
                hash: 42,
                medium: KvMedium::Host,
            },
            KvEvent::AllCleared,
        ];
        let got = encode_batch(2.0, &events, 1, 2);
        let mut want = vec![0x93, 0xcb];
        want.extend(2.0f64.to_be_bytes());
        want.push(0x93);
        want.extend([0x97, 0xab]);
        want.extend(b"BlockStored");
        want.extend([0x91, 42, 0xc0, 0x92, 1, 0xcd, 0x01, 0x2c, 2, 0xc0, 0xa3]);
        want.extend(b"GPU");
        want.extend([0x93, 0xac]);
        want.extend(b"BlockRemoved");
        want.extend([0x91, 42, 0xa3]);
        want.extend(b"CPU");
        want.extend([0x91, 0xb0]);
        want.extend(b"AllBlocksCleared");
        want.push(1);
        assert_eq!(got, want);
    }

    #[test]
    fn a_block_computed_under_a_lora_adapter_carries_its_id() {
        let stored = |lora| KvEvent::Stored {
            hash: 42,
            parent: Some(7),
            tokens: vec![1].into(),
            lora,
            medium: KvMedium::Device,
        };
        let mut want = vec![0x93, 0xcb];
        want.extend(2.0f64.to_be_bytes());
        want.extend([0x91, 0x97, 0xab]);
        want.extend(b"BlockStored");
        // hash 42, parent 7, tokens [1], block size 2, lora_id 5, "GPU".
        want.extend([0x91, 42, 7, 0x91, 1, 2, 5, 0xa3]);
        want.extend(b"GPU");
        want.push(0);
        assert_eq!(encode_batch(2.0, &[stored(5)], 0, 2), want);
        // The base model's blocks: nil.
        let base = encode_batch(2.0, &[stored(0)], 0, 2);
        let at = want.len() - 6;
        assert_eq!(base[at], 0xc0);
    }
}
