//! Example jobs on keyshift's SDK, jobs the built-in aggregation cannot express, each with an
//! oracle that computes its expected output independently of the SDK:
//!
//! * [`dedup`]: each event id's first occurrence, again once its TTL has run out;
//! * [`silence`]: an alert when a device sends no heartbeat for a while, once per silence;
//! * [`orders`]: orders joined with their payments by order id (an interval join), and with
//!   their customer's tier at the order's time (a temporal join against a changing table);
//! * [`sessions`]: sessionization by user (gap-based session windows in event time, merged
//!   when a click bridges two sessions);
//! * [`page_views`]: views per page in tumbling windows, combined before the shuffle (a popular
//!   page is a hot key);
//! * [`count`]: the built-in job's count per key, as a program (to measure one against the
//!   other).
//!
//! [`input`] generates their deterministic inputs.

pub mod count;
pub mod dedup;
pub mod input;
pub mod orders;
pub mod page_views;
pub mod sessions;
pub mod silence;

use keyshift_sdk::dataflow::Job;
use std::time::Duration;

/// How long [`dedup`]'s program keeps an id (event time).
pub const DEDUP_TTL: Duration = Duration::from_secs(10);
/// How long after an order [`orders`]'s program joins a payment to it (event time).
pub const PAYMENT_WINDOW: Duration = Duration::from_secs(60);
/// The window of [`page_views`]'s program (event time).
pub const PAGE_VIEWS_WINDOW: Duration = Duration::from_secs(10);
/// The gap that ends a session of [`sessions`]'s program (event time).
pub const SESSION_GAP: Duration = Duration::from_secs(30);
/// How long [`silence`]'s program waits for a heartbeat before it alerts (event time, ms).
pub const SILENCE_MS: i64 = 30_000;

/// The example jobs as programs a worker image carries, by the name a StreamJob gives in
/// `spec.job.program.name`: `dedup` ([`dedup::job`] with [`DEDUP_TTL`]), `silence-alert`
/// ([`silence::job`] with [`SILENCE_MS`]), `sessions` ([`sessions::job`] with [`SESSION_GAP`]),
/// `order-payments` ([`orders::job`] with [`PAYMENT_WINDOW`]), `page-views` ([`page_views::job`]
/// with [`PAGE_VIEWS_WINDOW`]) and `count` ([`count::job`]).
pub fn programs() -> Vec<(&'static str, Job)> {
    vec![
        ("count", count::job()),
        ("dedup", dedup::job(DEDUP_TTL)),
        ("order-payments", orders::job(PAYMENT_WINDOW)),
        ("page-views", page_views::job(PAGE_VIEWS_WINDOW)),
        ("sessions", sessions::job(SESSION_GAP)),
        ("silence-alert", silence::job(SILENCE_MS)),
    ]
}
