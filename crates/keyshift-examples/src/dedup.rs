//! Deduplication by event id with a TTL: emits an event the first time its id is seen, and
//! again once `ttl` of event time has passed since the id was last emitted (the `seen` state
//! expires). Each subtask also counts the duplicates it dropped in an operator list state
//! (`dropped`, split at a rescale: its entries add up to every duplicate the job dropped,
//! whatever the parallelism).

use crate::input::{Rng, jitter};
use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// An event with an id that may be delivered more than once.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Event {
    pub id: String,
    pub ts: i64,
    /// Which delivery this is (1 for the first of a burst).
    pub delivery: u32,
}

/// The keyed step, keyed by [`Event::id`].
#[derive(Debug, Clone)]
pub struct Dedup {
    pub ttl: Duration,
}

impl KeyedProcessFunction for Dedup {
    type Key = String;
    type In = Event;
    type Out = Event;
    type State = (ValueHandle<bool>, OperatorListHandle<u64>);

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        Ok((
            states.value(ValueStateDescriptor::new("seen").ttl(Ttl::event_time(self.ttl)))?,
            states.operator_list(OperatorListStateDescriptor::new(DROPPED).split())?,
        ))
    }

    fn process(
        &mut self,
        event: Event,
        (seen, dropped): &Self::State,
        ctx: &mut Context<'_, String, Event>,
    ) -> keyshift_sdk::Result<()> {
        if ctx.value(seen).get()?.is_none() {
            ctx.value(seen).set(true)?;
            ctx.emit(event);
        } else {
            // One running count per subtask; a subtask that took over several after a
            // rescale adds to the last.
            let mut counts = ctx.operator_list(dropped).get()?;
            match counts.last_mut() {
                Some(n) => *n += 1,
                None => counts.push(1),
            }
            ctx.operator_list(dropped).update(&counts)?;
        }
        Ok(())
    }
}

/// The operator state in which each subtask counts the duplicates it dropped.
pub const DROPPED: &str = "dropped";

/// The duplicates the `dropped` entries count (each a subtask's running count, postcard).
pub fn dropped_total(entries: &[Vec<u8>]) -> Result<u64, keyshift_sdk::serializer::SerializeError> {
    let counts = Postcard::<u64>::default();
    entries.iter().map(|e| counts.deserialize(e)).sum()
}

/// The duplicates a snapshot's operator-state `sections` (one per subtask of the run that wrote
/// them) say the job dropped.
pub fn dropped_in_sections(sections: &[&[u8]]) -> Result<u64, String> {
    let mut total = 0;
    for s in sections {
        let section =
            keyshift_sdk::operator_state::OperatorStates::decode(s).map_err(|e| e.to_string())?;
        for (decl, entries) in &section.states {
            if decl.name == DROPPED {
                total += dropped_total(entries).map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(total)
}

/// The whole job: JSON events from source `events`, deduplicated by id, to sink `unique`.
pub fn job(ttl: Duration) -> Job {
    Job::json_lines::<Event>("dedup", "events", |e| e.ts)
        .key_by(|e| e.id.clone())
        .process("dedup", move || Dedup { ttl })
        .to_json_lines("unique")
}

/// Generated traffic: `ids` ids, each delivered in bursts of 1 to 3 deliveries within
/// `burst_ms`, bursts of one id at least `gap_ms` apart; about one record per `step_ms`.
#[derive(Debug, Clone, Copy)]
pub struct Traffic {
    pub ids: u64,
    pub bursts_per_id: u64,
    pub burst_ms: i64,
    pub gap_ms: i64,
    pub step_ms: i64,
    pub max_out_of_orderness: i64,
    pub seed: u64,
}

impl Traffic {
    /// The records in arrival order, as (key, event time, event).
    pub fn records(&self) -> Vec<(String, i64, Event)> {
        let mut rng = Rng::new(self.seed);
        let mut events = Vec::new();
        // Ids start staggered over one gap; each burst of an id starts `gap_ms` plus up to a
        // burst after its last.
        for i in 0..self.ids {
            let id = format!("evt-{i}");
            let mut t = rng.below(self.gap_ms as u64) as i64;
            for _ in 0..self.bursts_per_id {
                let copies = 1 + rng.below(3) as u32;
                for d in 0..copies {
                    let ts = t + rng.below(self.burst_ms as u64) as i64 * i64::from(d.min(1));
                    events.push((
                        ts,
                        Event {
                            id: id.clone(),
                            ts,
                            delivery: d + 1,
                        },
                    ));
                }
                t += self.gap_ms + self.burst_ms + rng.below(self.burst_ms as u64) as i64;
            }
        }
        events.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
        jitter(events, self.max_out_of_orderness, &mut rng)
            .into_iter()
            .map(|(ts, e)| (e.id.clone(), ts, e))
            .collect()
    }
}

/// The oracle: the dedup's rule applied to the records in arrival order, without the SDK. A
/// delivery is emitted when its id was never emitted, or last emitted at least `ttl_ms` of
/// event time before it (the `seen` state, written at an emission, has expired by then);
/// otherwise it is dropped. Every record must be ahead of the watermark when it arrives (a
/// record behind it would see the watermark's time, which only the runtime knows): the
/// generators here keep that. Returns the emitted deliveries, sorted.
pub fn expected(records: &[(String, i64, Event)], ttl_ms: i64) -> Vec<Event> {
    let mut emitted_at: BTreeMap<&str, i64> = BTreeMap::new();
    let mut out = Vec::new();
    for (_, _, e) in records {
        if emitted_at
            .get(e.id.as_str())
            .is_none_or(|at| e.ts >= at.saturating_add(ttl_ms))
        {
            emitted_at.insert(&e.id, e.ts);
            out.push(e.clone());
        }
    }
    out.sort();
    out
}
