//! The output formats every command shares (`-o table|json|yaml`): the `keyshift` commands and
//! the offline savepoint tools alike.

use clap::ValueEnum;
use serde::Serialize;

/// Output formats of a command that prints a report.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table for people.
    #[default]
    Table,
    /// One JSON object (per key for `keygroup`), for programs.
    Json,
    /// The same document as `json`, as YAML (one YAML document per key for `keygroup`).
    Yaml,
}

/// `value` as YAML: the same document as its JSON.
pub fn yaml<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(value)
}

/// Why a report could not be rendered as a document.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("rendering JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("rendering YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
}

/// A report as `output` asks: `table` of it for people, or the document as (pretty) JSON or YAML.
pub fn render<T: Serialize>(
    report: &T,
    output: Output,
    table: impl FnOnce(&T) -> String,
) -> Result<String, RenderError> {
    Ok(match output {
        Output::Table => table(report),
        Output::Json => serde_json::to_string_pretty(report)? + "\n",
        Output::Yaml => yaml(report)?,
    })
}

/// Output formats of `keyshift plan`: [`Output`]'s and a picture.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum PlanOutput {
    /// A table for people.
    #[default]
    Table,
    /// One JSON object, for programs.
    Json,
    /// The same document as `json`, as YAML.
    Yaml,
    /// An SVG picture: each subtask's range in its own colour, the old strip above the new one
    /// with the groups that change owner marked (with --from-parallelism), groups per subtask.
    Svg,
}
