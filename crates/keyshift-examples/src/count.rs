//! The built-in job's count as a program: per key, how many records it has seen, kept in one
//! value state. It emits nothing per record (as the built-in count without a window emits only
//! with checkpoints), so that `keyshift bench programs` compares the two paths record for
//! record.

use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};

/// A record: its key and event time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Keyed {
    pub key: String,
    #[serde(default)]
    pub ts: i64,
}

/// The keyed step, keyed by [`Keyed::key`].
#[derive(Debug, Clone, Copy)]
pub struct Count;

impl KeyedProcessFunction for Count {
    type Key = String;
    type In = Keyed;
    type Out = (String, u64);
    type State = ValueHandle<u64>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.value(ValueStateDescriptor::new("count"))
    }

    fn process(
        &mut self,
        _record: Keyed,
        count: &Self::State,
        ctx: &mut Context<'_, String, (String, u64)>,
    ) -> keyshift_sdk::Result<()> {
        let n = ctx.value(count).get()?.unwrap_or(0) + 1;
        ctx.value(count).set(n)?;
        Ok(())
    }
}

/// The whole job: JSON records `{"key": ..., "ts": ...}` from source `records`, counted per key.
pub fn job() -> Job {
    Job::json_lines::<Keyed>("count", "records", |r| r.ts)
        .key_by(|r| r.key.clone())
        .process("count", || Count)
        .to_json_lines("counts")
}
