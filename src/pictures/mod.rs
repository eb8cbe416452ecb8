//! The documentation's pictures, drawn by code so they stay true: the architecture diagram
//! (from a declarative description), the timeline of a real rescale (from its recorded JSON)
//! and the benchmark charts (from the numbers of `docs/benchmarks.md`, kept as JSON).
//! All pure; `tests/pictures.rs` reads the data files under `docs/data/`, draws every picture
//! and fails when a committed SVG under `docs/` differs (`UPDATE_PICTURES=1` rewrites them).

pub mod architecture;
pub mod charts;
pub mod timeline;
