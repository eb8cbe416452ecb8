//! What the operator and the worker image agree on for a worker pod: the ports the worker listens
//! on, the environment variables the operator sets on its container (and the spec therefore may not
//! set), and the scratch volume that gives the worker a writable `/tmp` on a read-only root
//! filesystem. The operator builds pods from these and the validation refuses specs that collide
//! with them.

/// The worker's control API port (start, snapshots, status).
pub const CONTROL_PORT: u16 = 9090;
/// The worker's data-plane port (the key-group shuffle between subtasks).
pub const DATA_PORT: u16 = 9091;
/// The worker container's pod-IP variable (its listen addresses are built from it).
pub const ENV_POD_IP: &str = "POD_IP";
/// The worker container's control-token variable.
pub const ENV_TOKEN: &str = "KEYSHIFT_TOKEN";
/// The worker container's subtask-index variable.
pub const ENV_SUBTASK: &str = "KEYSHIFT_SUBTASK";
/// The worker's log format, `json` or `text` (the default): the operator sets it to its own
/// (`--log-format`, the chart's `logFormat`), so one setting governs the operator's and the
/// workers' lines, unless spec.podTemplate.env sets it for the job.
pub const ENV_LOG_FORMAT: &str = "KEYSHIFT_LOG_FORMAT";
/// Every environment variable the operator sets on the worker container: refused in
/// spec.podTemplate.env.
pub const RESERVED_ENV: &[&str] = &[ENV_POD_IP, ENV_TOKEN, ENV_SUBTASK];
/// The emptyDir volume that gives the worker a writable /tmp on its read-only root filesystem:
/// its name is refused in spec.podTemplate.volumes, its path in spec.podTemplate.volumeMounts.
pub const SCRATCH_VOLUME: &str = "tmp";
/// Where [`SCRATCH_VOLUME`] is mounted.
pub const SCRATCH_PATH: &str = "/tmp";
