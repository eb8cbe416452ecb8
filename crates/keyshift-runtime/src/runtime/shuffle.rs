//! The data plane between subtasks: messages, their wire form, and TCP connections.
//!
//! Every subtask's sources send each record to the subtask owning its key group. Locally that is a
//! bounded channel; between workers it is one TCP connection per (sender, receiver) pair carrying
//! length-prefixed frames. Channels and sockets are bounded, so a slow or aligning receiver pushes
//! back on the senders instead of growing memory.
//!
//! Frame: `u32 length (LE)` then `u8 tag` then the payload:
//! * `0` records: `u32 count`, then each record in [`crate::job::record::encode_record`] form;
//! * `1` barrier: `u64 id`;
//! * `2` watermark: `i64`;
//! * `3` hello: `u32 sender subtask`, a 32-byte proof, then the run id as UTF-8 (the
//!   connector's first frame);
//! * `4` challenge: 16 random bytes (the accepter's first frame);
//! * `5` a program's records: [`crate::job::record::encode_encoded`]; `7` the same with each
//!   record's weight (a program's values combined before the shuffle);
//! * `6` partial results of the built-in aggregation ([`crate::job::combine`]): `u32 count`,
//!   then each partial in [`crate::job::record::encode_record`] form followed by its `u32`
//!   weight.
//!
//! A connection is accepted only from a peer that holds the run's data-plane secret: the
//! accepter sends a fresh challenge, and the hello's proof is HMAC-SHA256(secret, challenge ||
//! sender || run id), checked in constant time. A proof seen on the wire is worth nothing for the
//! next connection (its challenge differs), and the secret itself never travels on the data plane.

use super::protocol::RunSecret;
use crate::job::Record;
use crate::job::combine::Partials;
use crate::job::record::{
    EncodedRecords, decode_encoded, decode_record, encode_encoded, encode_record,
};
use aws_lc_rs::hmac;
use std::io;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Records per batch before a sender flushes it downstream.
pub const BATCH: usize = 2048;
/// Batches buffered per channel.
pub const CHANNEL_BATCHES: usize = 16;
/// The largest frame accepted (a corrupt length must not allocate gigabytes).
const MAX_FRAME: usize = 256 << 20;

/// A message from an upstream subtask to a keyed operator.
#[derive(Debug, Clone, PartialEq)]
pub enum Msg {
    /// Records of the built-in aggregation.
    Records(Vec<Record>),
    /// Partial results of the built-in aggregation, combined by the sender.
    Partials(Partials),
    /// Records of a program, serialized by it.
    Encoded(EncodedRecords),
    /// Checkpoint barrier `id`: everything before it belongs to the snapshot.
    Barrier(u64),
    /// The sender's watermark advanced.
    Watermark(i64),
}

/// Data-plane failures.
#[derive(Debug, thiserror::Error)]
pub enum ShuffleError {
    #[error("data connection: {0}")]
    Io(#[from] io::Error),
    #[error("data connection from subtask {from}: malformed frame: {reason}")]
    Malformed { from: u32, reason: String },
    #[error("data connection: unexpected hello (run {got:?}, expected {expected:?})")]
    WrongRun { got: String, expected: String },
    #[error("data connection claiming subtask {from}: its proof of the run's secret is wrong")]
    Unauthenticated { from: u32 },
    #[error("data connection: {0}")]
    Random(String),
}

/// Bytes of a challenge.
const CHALLENGE: usize = 16;
/// Bytes of a hello's proof (HMAC-SHA256).
const PROOF: usize = 32;

fn proof_key(secret: &RunSecret) -> hmac::Key {
    hmac::Key::new(hmac::HMAC_SHA256, secret.0.as_bytes())
}

fn proof_message(challenge: &[u8], from: u32, run_id: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(challenge.len() + 4 + run_id.len());
    m.extend_from_slice(challenge);
    m.extend_from_slice(&from.to_le_bytes());
    m.extend_from_slice(run_id.as_bytes());
    m
}

fn encode(msg: &Msg, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&[0u8; 4]);
    match msg {
        Msg::Records(records) => {
            out.push(0);
            out.extend_from_slice(&(records.len() as u32).to_le_bytes());
            for r in records {
                encode_record(r, out);
            }
        }
        Msg::Partials(partials) => {
            out.push(6);
            out.extend_from_slice(&(partials.len() as u32).to_le_bytes());
            for (r, weight) in partials.iter() {
                encode_record(r, out);
                out.extend_from_slice(&weight.to_le_bytes());
            }
        }
        Msg::Encoded(batch) => {
            out.push(if batch.is_weighted() { 7 } else { 5 });
            encode_encoded(batch, out);
        }
        Msg::Barrier(id) => {
            out.push(1);
            out.extend_from_slice(&id.to_le_bytes());
        }
        Msg::Watermark(wm) => {
            out.push(2);
            out.extend_from_slice(&wm.to_le_bytes());
        }
    }
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
}

fn decode(from: u32, frame: &[u8]) -> Result<Msg, ShuffleError> {
    let bad = |reason: &str| ShuffleError::Malformed {
        from,
        reason: reason.to_owned(),
    };
    let (&tag, body) = frame.split_first().ok_or_else(|| bad("empty frame"))?;
    let fixed8 = |b: &[u8]| -> Result<[u8; 8], ShuffleError> {
        b.get(..8)
            .and_then(|s| s.try_into().ok())
            .ok_or_else(|| bad("short frame"))
    };
    let u32_at = |at: usize| -> Option<u32> {
        body.get(at..at + 4)
            .and_then(|s| s.try_into().ok())
            .map(u32::from_le_bytes)
    };
    match tag {
        0 => {
            let count = u32_at(0).ok_or_else(|| bad("short records frame"))? as usize;
            // Sized by what the frame can hold (a record is more than 8 bytes), never by the
            // count alone.
            let mut records = Vec::with_capacity(count.min(body.len() / 8));
            let mut at = 4;
            for _ in 0..count {
                let (r, n) = decode_record(&body[at..]).map_err(|e| bad(&e.to_string()))?;
                records.push(r);
                at += n;
            }
            Ok(Msg::Records(records))
        }
        6 => {
            let count = u32_at(0).ok_or_else(|| bad("short partials frame"))? as usize;
            let mut partials = Partials::with_capacity(count.min(body.len() / 12));
            let mut at = 4;
            for _ in 0..count {
                let (r, n) = decode_record(&body[at..]).map_err(|e| bad(&e.to_string()))?;
                let weight = u32_at(at + n).ok_or_else(|| bad("short partials frame"))?;
                partials.push(r, weight);
                at += n + 4;
            }
            Ok(Msg::Partials(partials))
        }
        5 | 7 => Ok(Msg::Encoded(
            decode_encoded(body, tag == 7).map_err(|e| bad(&e.to_string()))?,
        )),
        1 => Ok(Msg::Barrier(u64::from_le_bytes(fixed8(body)?))),
        2 => Ok(Msg::Watermark(i64::from_le_bytes(fixed8(body)?))),
        t => Err(bad(&format!("unknown tag {t}"))),
    }
}

/// Opens the connection to a peer and proves this subtask holds the run's secret; retries while
/// the peer starts.
pub async fn connect(
    addr: &str,
    from: u32,
    run_id: &str,
    secret: &RunSecret,
    deadline: tokio::time::Instant,
) -> Result<TcpStream, ShuffleError> {
    let mut delays = crate::backoff::peer_connect();
    loop {
        match TcpStream::connect(addr).await {
            Ok(mut s) => {
                s.set_nodelay(true)?;
                let challenge = tokio::time::timeout_at(deadline, read_challenge(&mut s))
                    .await
                    .map_err(|_| {
                        io::Error::new(io::ErrorKind::TimedOut, "no challenge from the peer")
                    })??;
                let tag = hmac::sign(&proof_key(secret), &proof_message(&challenge, from, run_id));
                let mut hello = Vec::with_capacity(8 + PROOF + run_id.len());
                hello.extend_from_slice(&((5 + PROOF + run_id.len()) as u32).to_le_bytes());
                hello.push(3);
                hello.extend_from_slice(&from.to_le_bytes());
                hello.extend_from_slice(tag.as_ref());
                hello.extend_from_slice(run_id.as_bytes());
                s.write_all(&hello).await?;
                return Ok(s);
            }
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(%addr, error = %e, "peer not reachable yet");
                let delay = delays
                    .next()
                    .unwrap_or(std::time::Duration::from_millis(200));
                // The last attempt is made at the deadline, not after it.
                tokio::time::sleep_until((tokio::time::Instant::now() + delay).min(deadline)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn read_challenge(s: &mut TcpStream) -> Result<[u8; CHALLENGE], ShuffleError> {
    let len = s.read_u32_le().await? as usize;
    let tag = s.read_u8().await?;
    if len != 1 + CHALLENGE || tag != 4 {
        return Err(ShuffleError::Malformed {
            from: u32::MAX,
            reason: "the peer's first frame is not a challenge".into(),
        });
    }
    let mut challenge = [0u8; CHALLENGE];
    s.read_exact(&mut challenge).await?;
    Ok(challenge)
}

/// Challenges an accepted connection and reads its hello: the sender's subtask index, once it
/// proved it holds the run's secret.
pub async fn accept_hello(
    s: &mut TcpStream,
    run_id: &str,
    secret: &RunSecret,
) -> Result<u32, ShuffleError> {
    let mut challenge = [0u8; CHALLENGE];
    getrandom::fill(&mut challenge).map_err(|e| ShuffleError::Random(e.to_string()))?;
    let mut frame = Vec::with_capacity(5 + CHALLENGE);
    frame.extend_from_slice(&((1 + CHALLENGE) as u32).to_le_bytes());
    frame.push(4);
    frame.extend_from_slice(&challenge);
    s.write_all(&frame).await?;
    let len = s.read_u32_le().await? as usize;
    if !(5 + PROOF..=4096).contains(&len) {
        return Err(ShuffleError::Malformed {
            from: u32::MAX,
            reason: format!("hello of {len} bytes"),
        });
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).await?;
    if buf[0] != 3 {
        return Err(ShuffleError::Malformed {
            from: u32::MAX,
            reason: "first frame is not a hello".into(),
        });
    }
    let from = u32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]]);
    let (proof, run) = buf[5..].split_at(PROOF);
    let got = String::from_utf8_lossy(run).into_owned();
    if got != run_id {
        return Err(ShuffleError::WrongRun {
            got,
            expected: run_id.to_owned(),
        });
    }
    hmac::verify(
        &proof_key(secret),
        &proof_message(&challenge, from, run_id),
        proof,
    )
    .map_err(|_| ShuffleError::Unauthenticated { from })?;
    Ok(from)
}

/// Forwards messages from a channel to a peer's socket until the channel closes.
pub async fn send_loop(stream: TcpStream, mut rx: mpsc::Receiver<Msg>) -> Result<(), ShuffleError> {
    let mut w = BufWriter::with_capacity(256 << 10, stream);
    let mut buf = Vec::with_capacity(64 << 10);
    while let Some(msg) = rx.recv().await {
        encode(&msg, &mut buf);
        w.write_all(&buf).await?;
        // Flush when nothing else is queued, so barriers and small batches do not wait.
        if rx.is_empty() {
            w.flush().await?;
        }
    }
    w.flush().await?;
    Ok(())
}

/// Reads frames from a peer's socket into the operator's input channel for that peer.
pub async fn recv_loop(
    from: u32,
    stream: TcpStream,
    tx: mpsc::Sender<Msg>,
) -> Result<(), ShuffleError> {
    let mut r = BufReader::with_capacity(256 << 10, stream);
    let mut buf = Vec::new();
    loop {
        let len = match r.read_u32_le().await {
            Ok(n) => n as usize,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if len == 0 || len > MAX_FRAME {
            return Err(ShuffleError::Malformed {
                from,
                reason: format!("frame of {len} bytes"),
            });
        }
        buf.resize(len, 0);
        r.read_exact(&mut buf).await?;
        let msg = decode(from, &buf)?;
        if tx.send(msg).await.is_err() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::RecordKey;

    /// The proof is standard HMAC-SHA256 (RFC 4231 test case 2), whichever crypto crate computes
    /// it: workers built with another provider (ring, before) interoperate during an upgrade.
    #[test]
    fn proof_is_standard_hmac_sha256() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"Jefe");
        let tag = hmac::sign(&key, b"what do ya want for nothing?");
        let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(tag.as_ref().len(), PROOF);
        let secret = RunSecret("s3cret".into());
        let msg = proof_message(&[7; CHALLENGE], 3, "run-1");
        let proof = hmac::sign(&proof_key(&secret), &msg);
        assert!(hmac::verify(&proof_key(&secret), &msg, proof.as_ref()).is_ok());
        let other = RunSecret("other".into());
        assert!(hmac::verify(&proof_key(&other), &msg, proof.as_ref()).is_err());
    }

    #[test]
    fn frames_round_trip() {
        let msgs = [
            Msg::Records(vec![
                Record {
                    key: RecordKey::string("key-1"),
                    value: 7,
                    ts: 1000,
                },
                Record {
                    key: RecordKey::long(-3),
                    value: -1,
                    ts: 2,
                },
            ]),
            Msg::Barrier(42),
            Msg::Watermark(-17),
            Msg::Records(vec![]),
            Msg::Encoded({
                let mut b = EncodedRecords::default();
                b.push(RecordKey::string("k"), 3, b"{}");
                b
            }),
            Msg::Encoded({
                let mut b = EncodedRecords::default();
                b.push(RecordKey::string("k"), 3, b"{}");
                b.push_weighted(RecordKey::string("hot"), 4, b"acc", 40);
                b
            }),
            Msg::Partials({
                let mut p = Partials::default();
                p.push(
                    Record {
                        key: RecordKey::string("hot"),
                        value: 614,
                        ts: 9,
                    },
                    614,
                );
                p.push(
                    Record {
                        key: RecordKey::int(5),
                        value: -4,
                        ts: 3,
                    },
                    u32::MAX,
                );
                p
            }),
            Msg::Partials(Partials::default()),
        ];
        let mut buf = Vec::new();
        for m in msgs {
            encode(&m, &mut buf);
            let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            assert_eq!(len, buf.len() - 4);
            assert_eq!(decode(0, &buf[4..]).unwrap(), m);
        }
        assert!(decode(0, &[9]).is_err());
        assert!(decode(0, &[1, 0, 0]).is_err());
        assert!(decode(0, &[0, 5, 0, 0, 0]).is_err());
    }

    proptest::proptest! {
        /// Fuzz: any frame body a peer sends (arbitrary, or a valid frame with bytes changed,
        /// cut or added) decodes to a message or a typed error, never a panic; a count that the
        /// body cannot hold never allocates by itself.
        #[test]
        fn frames_from_the_network_never_panic(
            arbitrary in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            flips in proptest::collection::vec((proptest::prelude::any::<usize>(), 1u8..=255), 0..4),
            cut in proptest::prelude::any::<usize>(),
            count in proptest::prelude::any::<u32>(),
        ) {
            let _ = decode(1, &arbitrary);
            let mut buf = Vec::new();
            encode(
                &Msg::Records(vec![
                    Record { key: RecordKey::string("k"), value: 1, ts: 2 },
                    Record { key: RecordKey::long(3), value: 4, ts: 5 },
                ]),
                &mut buf,
            );
            let mut frame = buf[4..].to_vec();
            for (i, b) in flips {
                let n = frame.len();
                frame[i % n] ^= b;
            }
            let _ = decode(1, &frame);
            frame.truncate(cut % (frame.len() + 1));
            let _ = decode(1, &frame);
            for tag in [0u8, 6] {
                let mut lying = vec![tag];
                lying.extend_from_slice(&count.to_le_bytes());
                proptest::prop_assert!(count == 0 || decode(1, &lying).is_err());
            }
            let mut partials = Partials::default();
            partials.push(Record { key: RecordKey::string("k"), value: 1, ts: 2 }, 3);
            encode(&Msg::Partials(partials), &mut buf);
            let mut frame = buf[4..].to_vec();
            frame.truncate(cut % (frame.len() + 1));
            let _ = decode(1, &frame);
        }
    }
}
