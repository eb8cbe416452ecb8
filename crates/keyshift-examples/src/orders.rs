//! Orders joined with their payments by order id (an interval join): each payment that arrives
//! within `window` of event time after its order is reported with the order, exactly once,
//! whichever of the two arrives first. Both sides are keyed by the order id, so an order and its
//! payments are in one key group and move together through every rescale.
//!
//! [`tiers_job`] shows the other join: orders enriched with their customer's tier as it was at
//! the order's event time (a temporal join against a slowly changing table kept as keyed state).

use crate::input::{Rng, jitter};
use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// An order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Order {
    pub id: String,
    pub customer: String,
    pub amount: i64,
    pub ts: i64,
}

/// A payment for an order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Payment {
    pub order: String,
    pub amount: i64,
    pub ts: i64,
}

/// A customer's tier from `ts` on (a row of the slowly changing table).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Tier {
    pub customer: String,
    pub tier: String,
    pub ts: i64,
}

/// One input line: `{"order": {...}}`, `{"payment": {...}}` or `{"tier": {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Event {
    Order(Order),
    Payment(Payment),
    Tier(Tier),
}

impl Event {
    /// Its event time.
    pub fn ts(&self) -> i64 {
        match self {
            Event::Order(o) => o.ts,
            Event::Payment(p) => p.ts,
            Event::Tier(t) => t.ts,
        }
    }
}

/// A payment reported with its order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Paid {
    pub order: String,
    pub customer: String,
    pub order_amount: i64,
    pub paid: i64,
    pub order_ts: i64,
    pub payment_ts: i64,
}

/// An order with its customer's tier at the order's time (`None`: the customer had none yet).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TieredOrder {
    pub order: String,
    pub customer: String,
    pub tier: Option<String>,
}

fn paid(o: &Order, p: &Payment) -> Paid {
    Paid {
        order: o.id.clone(),
        customer: o.customer.clone(),
        order_amount: o.amount,
        paid: p.amount,
        order_ts: o.ts,
        payment_ts: p.ts,
    }
}

fn tiered(o: &Order, t: Option<&Tier>) -> TieredOrder {
    TieredOrder {
        order: o.id.clone(),
        customer: o.customer.clone(),
        tier: t.map(|t| t.tier.clone()),
    }
}

/// The keyed step of [`job`]: payments within `window` after their order.
pub fn payments_join(
    window: Duration,
) -> impl KeyedProcessFunction<Key = String, In = JoinInput<Order, Payment>, Out = Paid> {
    IntervalJoin::around(Duration::ZERO, window, paid)
}

/// The keyed step of [`tiers_job`].
pub fn tiers_join()
-> impl KeyedProcessFunction<Key = String, In = JoinInput<Order, Tier>, Out = TieredOrder> {
    TemporalJoin::new(tiered)
}

/// The whole job: JSON events from source `events`, orders and payments joined by order id
/// (tiers ignored), each payment within `window` after its order to sink `paid`.
pub fn job(window: Duration) -> Job {
    Job::json_lines::<Event>("order-payments", "events", Event::ts)
        .flat_map(|e| match e {
            Event::Order(o) => Some(JoinInput::Left(o)),
            Event::Payment(p) => Some(JoinInput::Right(p)),
            Event::Tier(_) => None,
        })
        .key_by(|j: &JoinInput<Order, Payment>| match j {
            JoinInput::Left(o) => o.id.clone(),
            JoinInput::Right(p) => p.order.clone(),
        })
        .process("payments", move || payments_join(window))
        .to_json_lines("paid")
}

/// Orders with their customer's tier at the order's time, keyed by customer (payments ignored),
/// to sink `tiered`.
pub fn tiers_job() -> Job {
    Job::json_lines::<Event>("order-tiers", "events", Event::ts)
        .flat_map(|e| match e {
            Event::Order(o) => Some(JoinInput::Left(o)),
            Event::Tier(t) => Some(JoinInput::Right(t)),
            Event::Payment(_) => None,
        })
        .key_by(|j: &JoinInput<Order, Tier>| match j {
            JoinInput::Left(o) => o.customer.clone(),
            JoinInput::Right(t) => t.customer.clone(),
        })
        .process("tiers", tiers_join)
        .to_json_lines("tiered")
}

/// Generated shop traffic: `orders` orders over `customers` customers, one every `step_ms` or
/// so; each order paid 0 to 3 times at up to twice `window_ms` after it (so some payments fall
/// outside the window); each customer's tier changing every `tier_every_ms` or so. Out of
/// order within the bounded out-of-orderness.
#[derive(Debug, Clone, Copy)]
pub struct Shop {
    pub orders: u64,
    pub customers: u64,
    pub step_ms: i64,
    pub window_ms: i64,
    pub tier_every_ms: i64,
    pub max_out_of_orderness: i64,
    pub seed: u64,
}

impl Shop {
    /// The events in arrival order, with their event times.
    pub fn events(&self) -> Vec<(i64, Event)> {
        let mut rng = Rng::new(self.seed);
        let mut events = Vec::new();
        let mut t = 0;
        for i in 0..self.orders {
            t += 1 + rng.below(self.step_ms as u64) as i64;
            let id = format!("order-{i}");
            let customer = format!("customer-{}", rng.below(self.customers));
            events.push(Event::Order(Order {
                id: id.clone(),
                customer,
                amount: 1 + rng.below(500) as i64,
                ts: t,
            }));
            for _ in 0..rng.below(4) {
                events.push(Event::Payment(Payment {
                    order: id.clone(),
                    amount: 1 + rng.below(500) as i64,
                    ts: t + rng.below(2 * self.window_ms as u64) as i64,
                }));
            }
        }
        let end = t;
        for c in 0..self.customers {
            let mut at = rng.below(self.tier_every_ms as u64) as i64;
            let mut level = 0;
            while at < end {
                level += 1;
                events.push(Event::Tier(Tier {
                    customer: format!("customer-{c}"),
                    tier: format!("tier-{level}"),
                    ts: at,
                }));
                at += 1 + rng.below(2 * self.tier_every_ms as u64) as i64;
            }
        }
        let mut timed: Vec<(i64, Event)> = events.into_iter().map(|e| (e.ts(), e)).collect();
        timed.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| format!("{:?}", a.1).cmp(&format!("{:?}", b.1)))
        });
        jitter(timed, self.max_out_of_orderness, &mut rng)
    }
}

/// The interval join's oracle: every (order, payment) pair of one order id with the payment's
/// time in `[order, order + window_ms]`. Computed from the events alone.
pub fn expected_paid(events: &[(i64, Event)], window_ms: i64) -> Vec<Paid> {
    let mut orders: BTreeMap<&str, Vec<&Order>> = BTreeMap::new();
    for (_, e) in events {
        if let Event::Order(o) = e {
            orders.entry(&o.id).or_default().push(o);
        }
    }
    let mut out = Vec::new();
    for (_, e) in events {
        if let Event::Payment(p) = e {
            for o in orders.get(p.order.as_str()).into_iter().flatten() {
                if (o.ts..=o.ts + window_ms).contains(&p.ts) {
                    out.push(paid(o, p));
                }
            }
        }
    }
    out.sort();
    out
}

/// The temporal join's oracle: each order with the tier its customer got last at or before the
/// order's time (of two at one time, the one that arrived last).
pub fn expected_tiered(events: &[(i64, Event)]) -> Vec<TieredOrder> {
    let mut tiers: BTreeMap<&str, BTreeMap<i64, &Tier>> = BTreeMap::new();
    for (_, e) in events {
        if let Event::Tier(t) = e {
            tiers.entry(&t.customer).or_default().insert(t.ts, t);
        }
    }
    let mut out: Vec<TieredOrder> = events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Order(o) => {
                let t = tiers
                    .get(o.customer.as_str())
                    .and_then(|v| v.range(..=o.ts).next_back().map(|(_, t)| *t));
                Some(tiered(o, t))
            }
            _ => None,
        })
        .collect();
    out.sort();
    out
}
