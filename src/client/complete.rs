//! Completion of `kubectl keyshift ...`: kubectl (1.26 and later) runs
//! `kubectl_complete-keyshift WORD... PARTIAL` and reads cobra's answer (candidates one per line,
//! then `:<directive>`). What to offer is decided from the command's own definition (pure);
//! only job names are read from the cluster.

use super::{ClientError, Cluster, ClusterArgs};
use clap::Command;

/// What a completion needs.
#[derive(Debug, PartialEq, Eq)]
pub enum Need {
    /// These candidates (name, description).
    Candidates(Vec<(String, String)>),
    /// The names of the jobs in the namespace the words name, that start with `prefix`.
    Jobs {
        cluster: ClusterArgs,
        prefix: String,
    },
}

/// What to offer after `words` (the last one is the word being completed, maybe empty), for
/// the `job` command `job`.
pub fn need(job: &Command, words: &[String]) -> Need {
    let (partial, done) = match words.split_last() {
        Some((last, rest)) => (last.as_str(), rest),
        None => ("", &[][..]),
    };
    let mut cluster = ClusterArgs::default();
    let mut sub: Option<&Command> = None;
    let mut positionals = 0;
    let mut i = 0;
    while i < done.len() {
        let w = &done[i];
        if let Some(flag) = w.strip_prefix('-') {
            let (name, inline) = match flag.trim_start_matches('-').split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (flag.trim_start_matches('-'), None),
            };
            if takes_value(job, sub, name) {
                let value = inline.or_else(|| {
                    i += 1;
                    done.get(i).cloned()
                });
                match name {
                    "n" | "namespace" => cluster.namespace = value,
                    "context" => cluster.context = value,
                    "kubeconfig" => cluster.kubeconfig = value.map(Into::into),
                    _ => {}
                }
            }
        } else if sub.is_some() {
            positionals += 1;
        } else {
            sub = job.find_subcommand(w);
        }
        i += 1;
    }
    // The value of a flag that takes one.
    if let Some(prev) = done.last().and_then(|w| w.strip_prefix('-'))
        && !prev.contains('=')
        && takes_value(job, sub, prev.trim_start_matches('-'))
    {
        let values = arg(job, sub, prev.trim_start_matches('-'))
            .map(|a| {
                a.get_possible_values()
                    .iter()
                    .map(|v| (v.get_name().to_owned(), String::new()))
                    .collect()
            })
            .unwrap_or_default();
        return Need::Candidates(starting_with(values, partial));
    }
    if partial.starts_with('-') {
        let flags = sub
            .into_iter()
            .chain(std::iter::once(job))
            .flat_map(Command::get_arguments)
            .filter_map(|a| {
                let about = a.get_help().map(ToString::to_string).unwrap_or_default();
                a.get_long().map(|l| (format!("--{l}"), first_line(&about)))
            })
            .collect();
        return Need::Candidates(starting_with(flags, partial));
    }
    match sub {
        None => Need::Candidates(starting_with(
            job.get_subcommands()
                .map(|s| {
                    let about = s.get_about().map(ToString::to_string).unwrap_or_default();
                    (s.get_name().to_owned(), first_line(&about))
                })
                .collect(),
            partial,
        )),
        Some(s) if positionals == 0 && names_a_job(s) => Need::Jobs {
            cluster,
            prefix: partial.to_owned(),
        },
        Some(_) => Need::Candidates(Vec::new()),
    }
}

/// Whether a subcommand's first positional argument is a job's name.
fn names_a_job(sub: &Command) -> bool {
    sub.get_positionals().any(|a| a.get_id() == "name")
}

fn arg<'a>(job: &'a Command, sub: Option<&'a Command>, name: &str) -> Option<&'a clap::Arg> {
    sub.into_iter()
        .chain(std::iter::once(job))
        .flat_map(Command::get_arguments)
        .find(|a| {
            a.get_long() == Some(name) || a.get_short().is_some_and(|c| c.to_string() == name)
        })
}

fn takes_value(job: &Command, sub: Option<&Command>, name: &str) -> bool {
    arg(job, sub, name).is_some_and(|a| {
        a.get_action().takes_values() && a.get_num_args().is_none_or(|n| n.min_values() > 0)
    })
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().to_owned()
}

/// The candidates that start with `prefix`.
pub fn starting_with(candidates: Vec<(String, String)>, prefix: &str) -> Vec<(String, String)> {
    candidates
        .into_iter()
        .filter(|(c, _)| c.starts_with(prefix))
        .collect()
}

/// Cobra's answer: `name\tdescription` lines, then `:4` (no file completion).
pub fn cobra_answer(candidates: &[(String, String)]) -> String {
    let mut s = String::new();
    for (name, about) in candidates {
        s.push_str(name);
        if !about.is_empty() {
            s.push('\t');
            s.push_str(about);
        }
        s.push('\n');
    }
    s.push_str(":4\n");
    s
}

/// The names of the StreamJobs in the namespace `cluster` names, with no description.
pub async fn job_names(cluster: &ClusterArgs) -> Result<Vec<(String, String)>, ClientError> {
    let jobs = Cluster::connect(cluster).await?.all_jobs().await?;
    Ok(jobs
        .into_iter()
        .filter_map(|j| j.metadata.name)
        .map(|n| (n, String::new()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn job() -> Command {
        crate::cli::Cli::command()
            .find_subcommand("job")
            .cloned()
            .unwrap()
    }

    fn words(w: &[&str]) -> Vec<String> {
        w.iter().map(|s| (*s).to_owned()).collect()
    }

    fn names(n: Need) -> Vec<String> {
        match n {
            Need::Candidates(c) => c.into_iter().map(|(n, _)| n).collect(),
            Need::Jobs { .. } => panic!("asked for jobs"),
        }
    }

    #[test]
    fn the_first_word_is_a_command() {
        assert_eq!(
            names(need(&job(), &words(&["s"]))),
            ["status", "savepoint", "suspend", "scale"]
        );
        let all = names(need(&job(), &words(&[""])));
        for c in [
            "status",
            "savepoint",
            "suspend",
            "resume",
            "scale",
            "plan",
            "version",
        ] {
            assert!(all.contains(&c.to_owned()), "{all:?}");
        }
    }

    #[test]
    fn a_job_name_is_read_from_the_namespace_the_flags_name() {
        assert_eq!(
            need(&job(), &words(&["-n", "team-a", "status", "cl"])),
            Need::Jobs {
                cluster: ClusterArgs {
                    namespace: Some("team-a".into()),
                    ..ClusterArgs::default()
                },
                prefix: "cl".into()
            }
        );
        assert_eq!(
            need(&job(), &words(&["scale", "--context=prod", ""])),
            Need::Jobs {
                cluster: ClusterArgs {
                    context: Some("prod".into()),
                    ..ClusterArgs::default()
                },
                prefix: String::new()
            }
        );
        // One name only; `version` takes none.
        assert_eq!(
            names(need(&job(), &words(&["status", "clicks", ""]))),
            Vec::<String>::new()
        );
        assert_eq!(
            names(need(&job(), &words(&["version", ""]))),
            Vec::<String>::new()
        );
    }

    #[test]
    fn flags_and_their_values() {
        let flags = names(need(&job(), &words(&["scale", "clicks", "--"])));
        for f in ["--replicas", "--wait", "--timeout", "--namespace"] {
            assert!(flags.contains(&f.to_owned()), "{flags:?}");
        }
        assert_eq!(
            names(need(&job(), &words(&["status", "clicks", "-o", ""]))),
            ["table", "json", "yaml"]
        );
        assert_eq!(
            names(need(&job(), &words(&["plan", "clicks", "--output", "s"]))),
            ["svg"]
        );
    }

    #[test]
    fn the_answer_is_cobras() {
        assert_eq!(
            cobra_answer(&[
                ("status".into(), "one screen".into()),
                ("x".into(), String::new())
            ]),
            "status\tone screen\nx\n:4\n"
        );
        assert_eq!(cobra_answer(&[]), ":4\n");
    }
}
