//! A silence alert: when a device sends no heartbeat for `silence` of event time, one alert,
//! naming the device and its last heartbeat; the next heartbeat starts a new watch.

use crate::input::{Rng, jitter};
use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A device's heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub device: String,
    pub ts: i64,
}

/// A silence: `device` sent nothing for the watch's length after `last_heartbeat`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Alert {
    pub device: String,
    pub last_heartbeat: i64,
}

/// The keyed step, keyed by [`Heartbeat::device`].
#[derive(Debug, Clone)]
pub struct SilenceAlert {
    /// Milliseconds of event time without a heartbeat that make a silence.
    pub silence_ms: i64,
}

impl KeyedProcessFunction for SilenceAlert {
    type Key = String;
    type In = Heartbeat;
    type Out = Alert;
    type State = ValueHandle<i64>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.value(ValueStateDescriptor::new("last-heartbeat"))
    }

    fn process(
        &mut self,
        beat: Heartbeat,
        last: &Self::State,
        ctx: &mut Context<'_, String, Alert>,
    ) -> keyshift_sdk::Result<()> {
        let previous = ctx.value(last).get()?;
        if let Some(p) = previous {
            if beat.ts <= p {
                // An older heartbeat than one already seen changes nothing.
                return Ok(());
            }
            if beat.ts <= p + self.silence_ms {
                // No silence after `p`: its watch is cancelled.
                ctx.delete_event_time_timer(p + self.silence_ms)?;
            }
        }
        ctx.value(last).set(beat.ts)?;
        ctx.register_event_time_timer(beat.ts + self.silence_ms)?;
        Ok(())
    }

    fn on_timer(
        &mut self,
        timer: Timer,
        _last: &Self::State,
        ctx: &mut Context<'_, String, Alert>,
    ) -> keyshift_sdk::Result<()> {
        let alert = Alert {
            device: ctx.key().clone(),
            last_heartbeat: timer.timestamp - self.silence_ms,
        };
        ctx.emit(alert);
        Ok(())
    }
}

/// The whole job: JSON heartbeats from source `heartbeats` (those without a device dropped),
/// alerts to sink `alerts`.
pub fn job(silence_ms: i64) -> Job {
    Job::json_lines::<Heartbeat>("silence-alert", "heartbeats", |b| b.ts)
        .filter(|b| !b.device.is_empty())
        .key_by(|b| b.device.clone())
        .process("silence", move || SilenceAlert { silence_ms })
        .to_json_lines("alerts")
}

/// Generated heartbeats: `devices` devices, each beating every `period_ms` (give or take a
/// quarter) and going silent now and then for longer than the watch, for `duration_ms`; each
/// device's heartbeats in order, devices interleaved with out-of-orderness.
#[derive(Debug, Clone, Copy)]
pub struct Fleet {
    pub devices: u64,
    pub period_ms: i64,
    pub silence_ms: i64,
    pub duration_ms: i64,
    /// One heartbeat in `outage_every` is followed by a silence.
    pub outage_every: u64,
    pub max_out_of_orderness: i64,
    pub seed: u64,
}

impl Fleet {
    /// The heartbeats in arrival order, as (key, event time, heartbeat).
    pub fn records(&self) -> Vec<(String, i64, Heartbeat)> {
        let mut rng = Rng::new(self.seed);
        let mut beats = Vec::new();
        for d in 0..self.devices {
            let device = format!("device-{d}");
            let mut t = rng.below(self.period_ms as u64) as i64;
            while t < self.duration_ms {
                beats.push((
                    t,
                    Heartbeat {
                        device: device.clone(),
                        ts: t,
                    },
                ));
                let quarter = (self.period_ms / 4).max(1) as u64;
                t += self.period_ms - self.period_ms / 8 + rng.below(quarter) as i64;
                if rng.below(self.outage_every) == 0 {
                    t += self.silence_ms + rng.below(self.silence_ms as u64) as i64;
                }
            }
        }
        beats.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.device.cmp(&b.1.device)));
        // Jitter only across devices: each device's own heartbeats stay in order (they are
        // further apart than the jitter).
        jitter(beats, self.max_out_of_orderness, &mut rng)
            .into_iter()
            .map(|(ts, b)| (b.device.clone(), ts, b))
            .collect()
    }
}

/// The oracle: for each device, every heartbeat followed by none within `silence_ms` (the last
/// one included, once the input ends) is an alert. Computed from the heartbeats alone.
pub fn expected(records: &[(String, i64, Heartbeat)], silence_ms: i64) -> Vec<Alert> {
    let mut by_device: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (_, _, b) in records {
        by_device.entry(&b.device).or_default().push(b.ts);
    }
    let mut out = Vec::new();
    for (device, times) in by_device.iter_mut() {
        times.sort_unstable();
        times.dedup();
        for (i, t) in times.iter().enumerate() {
            if times.get(i + 1).is_none_or(|next| next - t > silence_ms) {
                out.push(Alert {
                    device: (*device).to_owned(),
                    last_heartbeat: *t,
                });
            }
        }
    }
    out.sort();
    out
}
