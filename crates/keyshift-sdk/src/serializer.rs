//! How state values and records become bytes: a [`Serializer`] per state declaration (and per
//! record type that crosses a shuffle), named, so a snapshot records which one wrote it and a
//! restore under another is refused instead of misread.
//!
//! [`Postcard`] (compact, serde-driven) is the default; [`Json`] makes state readable by the
//! savepoint tools without the job's code. A job may bring its own.

use serde::Serialize;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;

/// A value that does not (de)serialize.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{serializer}: {message}")]
pub struct SerializeError {
    /// The serializer's name.
    pub serializer: &'static str,
    /// What went wrong.
    pub message: String,
}

/// Turns values of `T` into bytes and back.
pub trait Serializer<T>: Send + Sync {
    /// The name recorded in snapshots beside the state it wrote.
    fn name(&self) -> &'static str;
    /// Appends `value`'s bytes to `out`.
    fn serialize(&self, value: &T, out: &mut Vec<u8>) -> Result<(), SerializeError>;
    /// Reads a value from exactly `bytes`.
    fn deserialize(&self, bytes: &[u8]) -> Result<T, SerializeError>;
}

/// postcard: a compact binary form driven by the type's serde implementation (no schema in the
/// bytes: a state's type may change only with a new declaration version).
pub struct Postcard<T>(PhantomData<fn() -> T>);

impl<T> Default for Postcard<T> {
    fn default() -> Self {
        Postcard(PhantomData)
    }
}

impl<T: Serialize + DeserializeOwned + 'static> Serializer<T> for Postcard<T> {
    fn name(&self) -> &'static str {
        "postcard"
    }
    fn serialize(&self, value: &T, out: &mut Vec<u8>) -> Result<(), SerializeError> {
        let bytes = postcard::to_allocvec(value).map_err(|e| SerializeError {
            serializer: "postcard",
            message: e.to_string(),
        })?;
        out.extend_from_slice(&bytes);
        Ok(())
    }
    fn deserialize(&self, bytes: &[u8]) -> Result<T, SerializeError> {
        postcard::from_bytes(bytes).map_err(|e| SerializeError {
            serializer: "postcard",
            message: e.to_string(),
        })
    }
}

/// JSON: larger and slower than [`Postcard`], but self-describing (the savepoint tools show it
/// as it is) and tolerant of added optional fields.
pub struct Json<T>(PhantomData<fn() -> T>);

impl<T> Default for Json<T> {
    fn default() -> Self {
        Json(PhantomData)
    }
}

impl<T: Serialize + DeserializeOwned + 'static> Serializer<T> for Json<T> {
    fn name(&self) -> &'static str {
        "json"
    }
    fn serialize(&self, value: &T, out: &mut Vec<u8>) -> Result<(), SerializeError> {
        serde_json::to_writer(out, value).map_err(|e| SerializeError {
            serializer: "json",
            message: e.to_string(),
        })
    }
    fn deserialize(&self, bytes: &[u8]) -> Result<T, SerializeError> {
        serde_json::from_slice(bytes).map_err(|e| SerializeError {
            serializer: "json",
            message: e.to_string(),
        })
    }
}
