//! The architecture diagram (`docs/architecture.svg`), drawn from a declarative description:
//! boxes ([`Node`]) with their text, and paths ([`Edge`]) between anchors on those boxes, each of
//! a [`Flow`] (control, data plane, storage, token delivery). To change the picture, change
//! [`diagram`] and run `UPDATE_PICTURES=1 cargo test --test pictures` (tests/pictures.rs fails
//! while the committed SVG differs from what this draws).

use crate::svg::{self, Svg};

/// What travels along an edge; sets its colour, width and arrow heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// HTTP control calls, API server watches and applies.
    Control,
    /// Records, barriers and watermarks between workers.
    Data,
    /// Reads and writes of the object store.
    Storage,
    /// The control token reaching a pod.
    Token,
}

/// Every flow, in legend order.
pub const ALL_FLOWS: [Flow; 4] = [Flow::Control, Flow::Data, Flow::Storage, Flow::Token];

impl Flow {
    fn colour(self) -> &'static str {
        match self {
            Flow::Control => "#1f5fbf",
            Flow::Data => "#d9730d",
            Flow::Storage => "#2e8540",
            Flow::Token => "#777",
        }
    }
    fn label_colour(self) -> &'static str {
        match self {
            Flow::Data => "#b35c00",
            Flow::Token => "#555",
            f => f.colour(),
        }
    }
    fn marker(self) -> &'static str {
        match self {
            Flow::Control => "ah-control",
            Flow::Data => "ah-data",
            Flow::Storage => "ah-storage",
            Flow::Token => "ah-token",
        }
    }
    fn stroke(self) -> String {
        match self {
            Flow::Control | Flow::Storage => {
                format!(r#"stroke="{}" stroke-width="2""#, self.colour())
            }
            Flow::Data => format!(r#"stroke="{}" stroke-width="2.5""#, self.colour()),
            Flow::Token => format!(
                r#"stroke="{}" stroke-width="1.5" stroke-dasharray="5,3""#,
                self.colour()
            ),
        }
    }
    fn legend(self) -> &'static str {
        match self {
            Flow::Control => "control",
            Flow::Data => "data plane",
            Flow::Storage => "storage",
            Flow::Token => "token delivery",
        }
    }
}

/// How a box looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Look {
    /// The API server.
    Cluster,
    /// The operator's outer box.
    Operator,
    /// A part inside the operator (text centred).
    Part,
    /// A worker pod.
    Worker,
    /// The object store's outer box.
    Store,
    /// A layout inside the object store.
    StoreItem,
    /// An offline tool reading the store.
    Tool,
    /// Another platform for the same orchestration (dashed).
    Alternative,
}

impl Look {
    fn attrs(self) -> &'static str {
        match self {
            Look::Cluster => r##"rx="6" fill="#eef2f7" stroke="#6b7a90""##,
            Look::Operator => r##"rx="6" fill="#e8f0fb" stroke="#1f5fbf""##,
            Look::Part => r##"rx="4" fill="#fff" stroke="#7d9bd1""##,
            Look::Worker => r##"rx="6" fill="#fdf3e7" stroke="#d9730d""##,
            Look::Store => r##"rx="6" fill="#eef7ef" stroke="#2e8540""##,
            Look::StoreItem => r##"rx="4" fill="#fff" stroke="#8cc49a""##,
            Look::Tool => r##"rx="6" fill="#eef7ef" stroke="#2e8540""##,
            Look::Alternative => r##"rx="6" fill="#f5f5f5" stroke="#888" stroke-dasharray="6,4""##,
        }
    }
    fn centred(self) -> bool {
        self == Look::Part
    }
}

/// A line of text in a box.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line {
    Plain(&'static str),
    /// Smaller, grey: where the code lives.
    Note(&'static str),
    /// Monospace: a path in the store.
    Mono(&'static str),
    /// Monospace, grey: what writes that path.
    MonoNote(&'static str),
}

/// A box.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub id: &'static str,
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
    pub look: Look,
    pub title: String,
    pub lines: Vec<Line>,
}

/// A side of a box, for an edge's end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Side {
    Top,
    Bottom,
    Left,
    Right,
}

/// A point on a box's side, `at` of the way along it (0 = left/top end, 1 = right/bottom end).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Anchor {
    pub node: &'static str,
    pub side: Side,
    pub at: f64,
}

/// A path between two anchors.
#[derive(Debug, Clone, PartialEq)]
pub struct Edge {
    pub flow: Flow,
    pub from: Anchor,
    pub to: Anchor,
    /// Arrow heads at both ends (a two-way path).
    pub both_ways: bool,
    /// Bend through this control point (a quadratic curve) instead of a straight line.
    pub bend: Option<(f64, f64)>,
    /// Text beside the path: its first line's baseline position, anchored start or end.
    pub label: Option<Label>,
}

/// Text beside an edge, on a white background so lines do not run through it.
#[derive(Debug, Clone, PartialEq)]
pub struct Label {
    pub x: f64,
    pub y: f64,
    pub lines: Vec<&'static str>,
    pub anchor_end: bool,
    /// Written bottom to top along a vertical edge.
    pub vertical: bool,
}

/// The whole picture.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagram {
    pub title: &'static str,
    pub desc: &'static str,
    pub width: f64,
    pub height: f64,
    pub nodes: Vec<Node>,
    pub edges: Vec<Edge>,
}

fn node(
    id: &'static str,
    (x, y, w, h): (f64, f64, f64, f64),
    look: Look,
    title: &str,
    lines: &[Line],
) -> Node {
    Node {
        id,
        x,
        y,
        w,
        h,
        look,
        title: title.to_owned(),
        lines: lines.to_vec(),
    }
}

fn at(node: &'static str, side: Side, at: f64) -> Anchor {
    Anchor { node, side, at }
}

fn edge(flow: Flow, from: Anchor, to: Anchor, both_ways: bool) -> Edge {
    Edge {
        flow,
        from,
        to,
        both_ways,
        bend: None,
        label: None,
    }
}

fn label(x: f64, y: f64, lines: &[&'static str]) -> Option<Label> {
    Some(Label {
        x,
        y,
        lines: lines.to_vec(),
        anchor_end: false,
        vertical: false,
    })
}

/// The parts of keyshift and the paths between them.
pub fn diagram() -> Diagram {
    use Line::{Mono, MonoNote, Note, Plain};
    let mut nodes = vec![
        node(
            "api",
            (20.0, 60.0, 280.0, 130.0),
            Look::Cluster,
            "Kubernetes API server",
            &[
                Plain("StreamJob: spec, status.rescale.step"),
                Plain("worker Pods (one per subtask)"),
                Plain("Secret <job>-control: token"),
                Plain("Lease (operator leader election)"),
                Note("CRD + CEL rules: src/crd.rs, src/validation/"),
            ],
        ),
        node(
            "operator",
            (360.0, 60.0, 620.0, 170.0),
            Look::Operator,
            "keyshift operator (Deployment; the Lease holder reconciles) · src/operator/ + src/orchestrator/",
            &[],
        ),
        node(
            "pass",
            (375.0, 94.0, 140.0, 50.0),
            Look::Part,
            "pass/ · pods.rs",
            &[Plain("one action, pod port")],
        ),
        node(
            "decide",
            (525.0, 94.0, 140.0, 50.0),
            Look::Part,
            "decide/",
            &[Plain("pure next action")],
        ),
        node(
            "desired",
            (675.0, 94.0, 140.0, 50.0),
            Look::Part,
            "desired.rs",
            &[Plain("pods, Secret, NetworkPolicy")],
        ),
        node(
            "status",
            (825.0, 94.0, 140.0, 50.0),
            Look::Part,
            "status.rs",
            &[Plain("phase, conditions")],
        ),
        node(
            "run",
            (375.0, 158.0, 290.0, 58.0),
            Look::Part,
            "src/orchestrator/run.rs · timeouts.rs",
            &[
                Plain("run builder: coordinator, start request,"),
                Plain("identity, token, run id, timeouts"),
            ],
        ),
        node(
            "coordinator",
            (675.0, 158.0, 290.0, 58.0),
            Look::Part,
            "Coordinator · src/orchestrator/coordinator/",
            &[
                Plain("start, trigger snapshots, collect acks,"),
                Plain("commit manifest, publish sink, retention"),
            ],
        ),
    ];
    for (id, x, name, rule) in [
        (
            "worker0",
            20.0,
            "worker pod · subtask 0",
            "source: partitions p % n == 0",
        ),
        (
            "worker1",
            285.0,
            "worker pod · subtask 1",
            "source: partitions p % n == 1",
        ),
        (
            "workerN",
            550.0,
            "worker pod · subtask n-1",
            "source: partitions p % n == n-1",
        ),
    ] {
        nodes.push(node(
            id,
            (x, 300.0, 210.0, 160.0),
            Look::Worker,
            name,
            &[
                Plain("control API :9090"),
                Plain(rule),
                Plain("route record to group's owner"),
                Plain("keyed operator: align barriers,"),
                Plain("state per key group (in memory)"),
                Note("crates/keyshift-runtime: runtime/ + job/"),
                Plain("data plane :9091"),
            ],
        ));
    }
    nodes.extend([
        node(
            "local",
            (810.0, 262.0, 170.0, 92.0),
            Look::Alternative,
            "keyshift local",
            &[
                Plain("worker processes on"),
                Plain("loopback instead of pods;"),
                Plain("same orchestrator pass"),
                Plain("over a process port"),
            ],
        ),
        node(
            "tools",
            (810.0, 384.0, 170.0, 104.0),
            Look::Tool,
            "keyshift savepoint",
            &[
                Plain("list, inspect, verify,"),
                Plain("dump, rewrite, dispose"),
                Plain("(offline; runtime offline/)"),
                Plain("reads manifests, blocks"),
                Plain("and _in_use.json"),
            ],
        ),
        node(
            "store",
            (20.0, 580.0, 960.0, 170.0),
            Look::Store,
            "object store (file://, s3://, gs://, az://, memory://)",
            &[],
        ),
        node(
            "snapshots",
            (35.0, 614.0, 565.0, 124.0),
            Look::StoreItem,
            "snapshots: <storage>/<namespace>/<job>/ · keyshift-runtime snapshot/",
            &[
                Mono("checkpoints/chk-<id>/state-<i>-of-<p>.bin"),
                MonoNote("  key-group blocks, CRC-32C each (workers)"),
                Mono("checkpoints/chk-<id>/_manifest.json"),
                MonoNote("  create-only, written last (coordinator)"),
                Mono("savepoints/sp-<id>/... (same layout); _in_use.json (optional pins)"),
            ],
        ),
        node(
            "sink",
            (615.0, 614.0, 350.0, 124.0),
            Look::StoreItem,
            "object-store sink: <sink url>/ · keyshift-runtime sink.rs",
            &[
                Mono("_staging/snap-<id>/part-<i>-of-<p>.jsonl"),
                MonoNote("  staged by each worker at barrier <id>"),
                Mono("snap-<id>/part-<i>-of-<p>.jsonl"),
                MonoNote("  create-only copy after <id> commits"),
                MonoNote("  (coordinator); readers look only here"),
            ],
        ),
    ]);

    let mut edges = vec![
        Edge {
            label: label(330.0, 140.0, &["watch,", "apply"]).map(|mut l| {
                l.anchor_end = false;
                l
            }),
            ..edge(
                Flow::Control,
                at("api", Side::Right, 0.46),
                at("operator", Side::Left, 0.35),
                true,
            )
        },
        Edge {
            label: label(
                90.0,
                240.0,
                &["env KEYSHIFT_TOKEN", "from the Secret (kubelet)"],
            ),
            ..edge(
                Flow::Token,
                at("api", Side::Bottom, 0.214),
                at("worker0", Side::Top, 0.286),
                false,
            )
        },
    ];
    // The control fan: the operator calls every worker's control API.
    for (i, w) in ["worker0", "worker1", "workerN"].into_iter().enumerate() {
        edges.push(Edge {
            label: if i == 2 {
                label(
                    590.0,
                    252.0,
                    &["control API :9090, HTTP", "Authorization: Bearer <token>"],
                )
            } else {
                None
            },
            ..edge(
                Flow::Control,
                at("operator", Side::Bottom, 0.177),
                at(w, Side::Top, 0.5),
                false,
            )
        });
    }
    // The data plane between workers.
    edges.push(edge(
        Flow::Data,
        at("worker0", Side::Right, 0.81),
        at("worker1", Side::Left, 0.81),
        true,
    ));
    edges.push(edge(
        Flow::Data,
        at("worker1", Side::Right, 0.81),
        at("workerN", Side::Left, 0.81),
        true,
    ));
    edges.push(Edge {
        bend: Some((390.0, 500.0)),
        label: label(
            390.0,
            492.0,
            &["TCP shuffle: records, barriers, watermarks (run id hello)"],
        )
        .map(|mut l| {
            l.x = 236.0 + 4.0;
            l
        }),
        ..edge(
            Flow::Data,
            at("worker0", Side::Bottom, 0.5),
            at("workerN", Side::Bottom, 0.5),
            true,
        )
    });
    // Storage: state files both ways, sink staging one way, the coordinator's commits.
    edges.push(Edge {
        label: label(
            75.0,
            534.0,
            &[
                "every worker: its state file at each barrier;",
                "on restore, range-reads only its own key groups",
            ],
        ),
        ..edge(
            Flow::Storage,
            at("worker0", Side::Bottom, 0.19),
            at("snapshots", Side::Top, 0.044),
            true,
        )
    });
    edges.push(edge(
        Flow::Storage,
        at("worker1", Side::Bottom, 0.548),
        at("snapshots", Side::Top, 0.646),
        true,
    ));
    edges.push(edge(
        Flow::Storage,
        at("workerN", Side::Bottom, 0.119),
        at("store", Side::Top, 0.578),
        true,
    ));
    edges.push(Edge {
        label: Some(Label {
            x: 727.0,
            y: 534.0,
            lines: vec!["every worker: sink", "staging at barriers"],
            anchor_end: true,
            vertical: false,
        }),
        ..edge(
            Flow::Storage,
            at("workerN", Side::Bottom, 0.881),
            at("sink", Side::Top, 0.343),
            false,
        )
    });
    edges.push(Edge {
        label: Some(Label {
            x: 782.0,
            y: 470.0,
            lines: vec!["commit manifest · retention · publish"],
            anchor_end: false,
            vertical: true,
        }),
        ..edge(
            Flow::Storage,
            at("coordinator", Side::Bottom, 0.397),
            at("sink", Side::Top, 0.503),
            false,
        )
    });
    edges.push(edge(
        Flow::Storage,
        at("tools", Side::Bottom, 0.5),
        at("store", Side::Top, 0.911),
        true,
    ));

    Diagram {
        title: "keyshift: parts and paths",
        desc: "The operator talks to the Kubernetes API server and to each worker's control API (HTTP, bearer token from a per-job Secret). Workers exchange records, barriers and watermarks over the TCP data plane. Workers write state files and sink staging objects to the object store; the coordinator commits manifests, applies retention and publishes sink output; the savepoint tools read snapshots offline.",
        width: 1000.0,
        height: 770.0,
        nodes,
        edges,
    }
}

/// An anchor's point; `None` when its node is not in the diagram.
pub fn anchor_point(d: &Diagram, a: &Anchor) -> Option<(f64, f64)> {
    let n = d.nodes.iter().find(|n| n.id == a.node)?;
    Some(match a.side {
        Side::Top => (n.x + n.w * a.at, n.y),
        Side::Bottom => (n.x + n.w * a.at, n.y + n.h),
        Side::Left => (n.x, n.y + n.h * a.at),
        Side::Right => (n.x + n.w, n.y + n.h * a.at),
    })
}

/// Problems of a description: duplicate ids, edges to unknown boxes, boxes outside the picture.
pub fn problems(d: &Diagram) -> Vec<String> {
    let mut out = Vec::new();
    for (i, n) in d.nodes.iter().enumerate() {
        if d.nodes[..i].iter().any(|m| m.id == n.id) {
            out.push(format!("box {} is declared twice", n.id));
        }
        if n.x < 0.0 || n.y < 0.0 || n.x + n.w > d.width || n.y + n.h > d.height {
            out.push(format!("box {} lies outside the picture", n.id));
        }
    }
    for e in &d.edges {
        for a in [&e.from, &e.to] {
            if anchor_point(d, a).is_none() {
                out.push(format!("an edge ends at unknown box {}", a.node));
            }
            if !(0.0..=1.0).contains(&a.at) {
                out.push(format!("an edge ends off the side of box {}", a.node));
            }
        }
    }
    out
}

/// Moves a point `by` pixels towards `to` (so arrow heads stop at a box's border).
fn shorten(p: (f64, f64), to: (f64, f64), by: f64) -> (f64, f64) {
    let (dx, dy) = (to.0 - p.0, to.1 - p.1);
    let len = (dx * dx + dy * dy).sqrt();
    if len <= by {
        return p;
    }
    (p.0 + dx / len * by, p.1 + dy / len * by)
}

/// Draws the diagram.
pub fn render(d: &Diagram) -> String {
    let mut s = Svg::new(d.width);
    s.text(20.0, 32.0, d.title, r#"font-size="18" font-weight="bold""#);
    // Legend.
    let mut x = 470.0;
    for f in ALL_FLOWS {
        s.line(
            x,
            28.0,
            x + 35.0,
            28.0,
            &format!(r#"{} marker-end="url(#{})""#, f.stroke(), f.marker()),
        );
        s.text(x + 41.0, 32.0, f.legend(), r#"font-size="11""#);
        x += 41.0 + 7.0 * f.legend().len() as f64 + 20.0;
    }
    // Boxes, containers first (declaration order).
    for n in &d.nodes {
        s.rect(
            n.x,
            n.y,
            n.w,
            n.h,
            &format!(r#"class="box" data-id="{}" {}"#, n.id, n.look.attrs()),
        );
        let (tx, anchor) = if n.look.centred() {
            (n.x + n.w / 2.0, r#" text-anchor="middle""#)
        } else {
            (n.x + 12.0, "")
        };
        let title_size = match n.look {
            Look::Part | Look::StoreItem | Look::Tool | Look::Alternative => r#" font-size="12""#,
            _ => "",
        };
        let mut y = n.y + if n.look.centred() { 20.0 } else { 21.0 };
        s.text(
            tx,
            y,
            &n.title,
            &format!(r#"font-weight="bold"{title_size}{anchor}"#),
        );
        let (first, step) = match n.look {
            Look::Cluster => (22.0, 20.0),
            Look::Tool | Look::Alternative => (18.0, 15.0),
            _ => (19.0, 17.0),
        };
        y += first;
        for line in &n.lines {
            let (text, attrs) = match line {
                Line::Plain(t) => (t, "font-size=\"11\""),
                Line::Note(t) => (t, "font-size=\"10\" fill=\"#555\""),
                Line::Mono(t) => (
                    t,
                    "font-family=\"Menlo, Consolas, monospace\" font-size=\"11\"",
                ),
                Line::MonoNote(t) => (
                    t,
                    "font-family=\"Menlo, Consolas, monospace\" font-size=\"11\" fill=\"#555\"",
                ),
            };
            s.text(tx, y, text, &format!("{attrs}{anchor}"));
            y += step;
        }
    }
    // Edges, then their labels on white.
    for e in &d.edges {
        let (Some(a), Some(b)) = (anchor_point(d, &e.from), anchor_point(d, &e.to)) else {
            continue;
        };
        let towards_a = e.bend.unwrap_or(b);
        let towards_b = e.bend.unwrap_or(a);
        let a = shorten(a, towards_a, 2.0);
        let b = shorten(b, towards_b, 2.0);
        let heads = if e.both_ways {
            format!(
                r#" marker-start="url(#{m})" marker-end="url(#{m})""#,
                m = e.flow.marker()
            )
        } else {
            format!(r#" marker-end="url(#{})""#, e.flow.marker())
        };
        let attrs = format!(
            r#"class="edge" data-flow="{:?}" data-from="{}" data-to="{}" fill="none" {}{heads}"#,
            e.flow,
            e.from.node,
            e.to.node,
            e.flow.stroke()
        );
        match e.bend {
            Some((cx, cy)) => s.path(
                &format!(
                    "M{:.2},{:.2} Q{cx:.2},{cy:.2} {:.2},{:.2}",
                    a.0, a.1, b.0, b.1
                ),
                &attrs,
            ),
            None => s.line(a.0, a.1, b.0, b.1, &attrs),
        }
    }
    for e in &d.edges {
        let Some(l) = &e.label else { continue };
        let colour = e.flow.label_colour();
        if l.vertical {
            for (i, text) in l.lines.iter().enumerate() {
                s.text(
                    0.0,
                    0.0,
                    text,
                    &format!(
                        r#"font-size="11" fill="{colour}" transform="translate({:.2},{:.2}) rotate(-90)""#,
                        l.x - 14.0 * i as f64,
                        l.y
                    ),
                );
            }
            continue;
        }
        let widest = l.lines.iter().map(|t| t.chars().count()).max().unwrap_or(0) as f64 * 5.9;
        let height = 14.0 * l.lines.len() as f64;
        let left = if l.anchor_end {
            l.x - widest - 3.0
        } else {
            l.x - 3.0
        };
        s.rect(
            left,
            l.y - 12.0,
            widest + 6.0,
            height + 2.0,
            r##"fill="#ffffff""##,
        );
        let anchor = if l.anchor_end {
            r#" text-anchor="end""#
        } else {
            ""
        };
        for (i, text) in l.lines.iter().enumerate() {
            s.text(
                l.x,
                l.y + 14.0 * i as f64,
                text,
                &format!(r#"font-size="11" fill="{colour}"{anchor}"#),
            );
        }
    }
    let defs: String = ALL_FLOWS
        .iter()
        .map(|f| svg::arrow_marker(f.marker(), f.colour()))
        .collect();
    s.finish_with_desc(d.height, d.title, d.desc, &defs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_description_is_consistent() {
        let d = diagram();
        assert_eq!(problems(&d), Vec::<String>::new());
    }

    #[test]
    fn problems_are_found() {
        let mut d = diagram();
        d.edges[0].to.node = "nowhere";
        d.nodes.push(d.nodes[0].clone());
        let p = problems(&d);
        assert!(p.iter().any(|m| m.contains("unknown box nowhere")), "{p:?}");
        assert!(
            p.iter().any(|m| m.contains("box api is declared twice")),
            "{p:?}"
        );
    }

    #[test]
    fn every_box_and_edge_is_drawn() {
        let d = diagram();
        let svg = render(&d);
        assert_eq!(svg.matches(r#"class="box""#).count(), d.nodes.len());
        assert_eq!(svg.matches(r#"class="edge""#).count(), d.edges.len());
        for f in ALL_FLOWS {
            assert!(
                svg.contains(&format!(r#"data-flow="{f:?}""#)),
                "{f:?} has no edge"
            );
        }
        assert!(svg.contains("Secret &lt;job&gt;-control: token"));
    }
}
