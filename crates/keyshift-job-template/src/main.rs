//! A job of your own on keyshift, as a template: per account, the running total of its
//! payments, and one record when that total first reaches [`THRESHOLD`].
//!
//! The job is a dataflow written with `keyshift-sdk` (a JSON-lines source, a filter, `key_by`,
//! a keyed step with one value state, a JSON-lines sink); `main` hands it to the worker runtime
//! under the name a StreamJob selects it by (`spec.job.program.name: threshold`). Everything the
//! step keeps is in its declared state, per key and so per key group: keyshift checkpoints it,
//! restores it, and moves it on a rescale. Replace [`Threshold`] and [`job`] with your own.

use keyshift_runtime::job::Programs;
use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use std::process::ExitCode;

/// The total at which an account is reported.
pub const THRESHOLD: i64 = 1_000;

/// An input record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Payment {
    pub account: String,
    pub amount: i64,
    /// Event time, ms since the epoch.
    pub ts: i64,
}

/// An output record: `account`'s total reached the threshold with the payment at `ts`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Crossed {
    pub account: String,
    pub total: i64,
    pub ts: i64,
}

/// The keyed step, keyed by [`Payment::account`].
pub struct Threshold;

impl KeyedProcessFunction for Threshold {
    type Key = String;
    type In = Payment;
    type Out = Crossed;
    type State = ValueHandle<i64>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.value(ValueStateDescriptor::new("total"))
    }

    fn process(
        &mut self,
        payment: Payment,
        total: &Self::State,
        ctx: &mut Context<'_, String, Crossed>,
    ) -> keyshift_sdk::Result<()> {
        let before = ctx.value(total).get()?.unwrap_or(0);
        let after = before.saturating_add(payment.amount);
        ctx.value(total).set(after)?;
        if before < THRESHOLD && after >= THRESHOLD {
            ctx.emit(Crossed {
                account: payment.account,
                total: after,
                ts: payment.ts,
            });
        }
        Ok(())
    }
}

/// The whole job: payments (positive amounts only) from source `payments`, keyed by account,
/// crossings to sink `crossed`. The step's uid (`threshold`) names its state in snapshots: keep
/// it across releases.
pub fn job() -> Job {
    Job::json_lines::<Payment>("threshold", "payments", |p| p.ts)
        .filter(|p| p.amount > 0)
        .key_by(|p| p.account.clone())
        .process("threshold", || Threshold)
        .to_json_lines("crossed")
}

fn main() -> ExitCode {
    match Programs::new().with("threshold", job()) {
        Ok(programs) => keyshift_runtime::runtime::worker::main(programs),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
