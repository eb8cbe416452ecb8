//! Fault injection for `tests/faults.rs`, with real components only: an HTTP relay in front of
//! the S3 test server (`hack/s3-server.sh`) that fails, slows, truncates, shortens or corrupts
//! chosen requests, and a small tmpfs that can be filled to the last byte.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// What the relay does to a matching request.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Answers with this HTTP status and an S3 error document; the store never sees the request.
    Status(u16),
    /// Forwards the request, and holds its answer back this long before sending it.
    Delay(Duration),
    /// Sends the answer's head with its full `Content-Length`, then half of the body, then
    /// closes the connection (a read cut off mid-body).
    Truncate,
    /// A range read answered with fewer bytes than asked for: the `Content-Range` is unchanged,
    /// the body is cut to half and the `Content-Length` says so (the connection ends cleanly).
    Short,
    /// Flips one bit in the middle of the body (same length).
    Corrupt,
    /// Changes the first number after `needle` in the body ([`flip_digit_after`]): the bytes
    /// stay well-formed JSON, only a number changes.
    FlipDigitAfter(String),
    /// Waits this long, then applies the inner fault (so other requests get ahead of it).
    After(Duration, Box<Fault>),
}

/// One fault: for requests with `method` whose path contains every one of `path`, up to
/// `times` times.
#[derive(Debug)]
struct Rule {
    method: String,
    path: Vec<String>,
    fault: Fault,
    remaining: usize,
    applied: Arc<AtomicUsize>,
}

#[derive(Default)]
struct Shared {
    rules: Mutex<Vec<Rule>>,
    /// Forwarded requests (any method), by path, for "this was read" checks.
    seen: Mutex<Vec<(String, String)>>,
}

/// How often a fault was applied (see [`FaultyS3::inject`]).
#[derive(Debug, Clone)]
pub struct Applied(Arc<AtomicUsize>);

impl Applied {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// An HTTP relay to the S3 test server that injects [`Fault`]s; one request per connection (it
/// answers with `Connection: close`).
pub struct FaultyS3 {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultyS3 {
    /// Starts a relay on the loopback to `upstream` (`host:port`); it runs until the process
    /// ends.
    pub fn start(upstream: &str) -> FaultyS3 {
        FaultyS3::start_on(std::net::Ipv4Addr::LOCALHOST, upstream)
    }

    /// Starts a relay on `ip` (any free port) to `upstream` (`host:port`).
    pub fn start_on(ip: std::net::Ipv4Addr, upstream: &str) -> FaultyS3 {
        let listener = TcpListener::bind((ip, 0)).expect("relay binds");
        let addr = listener.local_addr().expect("relay address");
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let upstream = upstream.to_owned();
        std::thread::spawn(move || {
            for conn in listener.incoming().map_while(Result::ok) {
                let (upstream, s) = (upstream.clone(), s.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &upstream, &s);
                });
            }
        });
        FaultyS3 { addr, shared }
    }

    /// The relay's URL, for `AWS_ENDPOINT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Applies `fault` to the next `times` requests with `method` whose path contains every
    /// string of `path` (`usize::MAX`: until [`clear`](Self::clear)).
    pub fn inject(&self, method: &str, path: &[&str], fault: Fault, times: usize) -> Applied {
        let applied = Arc::new(AtomicUsize::new(0));
        lock(&self.shared.rules).push(Rule {
            method: method.to_owned(),
            path: path.iter().map(|p| p.to_string()).collect(),
            fault,
            remaining: times,
            applied: applied.clone(),
        });
        Applied(applied)
    }

    /// Removes every fault whose path patterns include `tag` (each test tags its own).
    pub fn clear(&self, tag: &str) {
        lock(&self.shared.rules).retain(|r| !r.path.iter().any(|p| p == tag));
    }

    /// Forwarded requests with `method` whose path contains every string of `path`.
    pub fn forwarded(&self, method: &str, path: &[&str]) -> usize {
        lock(&self.shared.seen)
            .iter()
            .filter(|(m, p)| m == method && path.iter().all(|x| p.contains(x)))
            .count()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The fault for this request, if a rule matches (counting it).
fn take_fault(shared: &Shared, method: &str, path: &str) -> Option<Fault> {
    let mut rules = lock(&shared.rules);
    let rule = rules.iter_mut().find(|r| {
        r.remaining > 0 && r.method == method && r.path.iter().all(|p| path.contains(p.as_str()))
    })?;
    rule.remaining -= 1;
    rule.applied.fetch_add(1, Ordering::SeqCst);
    Some(rule.fault.clone())
}

/// Reads one HTTP head (up to and with the blank line); `None` at EOF.
fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<Vec<String>>> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        let line = line.trim_end_matches(['\r', '\n']).to_owned();
        if line.is_empty() {
            return Ok(Some(lines));
        }
        lines.push(line);
    }
}

fn header<'a>(head: &'a [String], name: &str) -> Option<&'a str> {
    head.iter()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
}

/// The head with `Connection: close` instead of any Connection header, and with
/// `Content-Length` replaced when `length` is given.
fn rewrite_head(head: &[String], length: Option<usize>) -> Vec<u8> {
    let mut out = String::new();
    for line in head.iter().filter(|l| {
        let l = l.to_ascii_lowercase();
        let replaced = length.is_some() && l.starts_with("content-length:");
        !l.starts_with("connection:") && !replaced
    }) {
        out.push_str(line);
        out.push_str("\r\n");
    }
    if let Some(n) = length {
        out.push_str(&format!("Content-Length: {n}\r\n"));
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

fn serve(client: TcpStream, upstream: &str, shared: &Shared) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let Some(head) = read_head(&mut reader)? else {
        return Ok(());
    };
    let length: usize = header(&head, "content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body)?;
    let mut words = head.first().map(String::as_str).unwrap_or("").split(' ');
    let (method, path) = (
        words.next().unwrap_or("").to_owned(),
        words.next().unwrap_or("").to_owned(),
    );
    let fault = match take_fault(shared, &method, &path) {
        Some(Fault::After(wait, inner)) => {
            std::thread::sleep(wait);
            Some(*inner)
        }
        other => other,
    };
    let mut client = client;
    if let Some(Fault::Status(code)) = fault {
        let (code_name, reason) = match code {
            503 => ("SlowDown", "Service Unavailable"),
            500 => ("InternalError", "Internal Server Error"),
            403 => ("AccessDenied", "Forbidden"),
            _ => ("InternalError", "Error"),
        };
        let xml = format!(
            "<Error><Code>{code_name}</Code><Message>injected by the test relay</Message></Error>"
        );
        write!(
            client,
            "HTTP/1.1 {code} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            xml.len()
        )?;
        if method != "HEAD" {
            client.write_all(xml.as_bytes())?;
        }
        return client.flush();
    }
    lock(&shared.seen).push((method.clone(), path.clone()));
    let mut up = TcpStream::connect(upstream)?;
    up.write_all(&rewrite_head(&head, None))?;
    up.write_all(&body)?;
    up.flush()?;
    let mut answer = BufReader::new(up);
    let Some(head) = read_head(&mut answer)? else {
        return Ok(());
    };
    let body_fault = match fault {
        Some(Fault::Delay(d)) => {
            std::thread::sleep(d);
            None
        }
        f => f,
    };
    let answer_length = header(&head, "content-length").and_then(|v| v.parse::<usize>().ok());
    match (body_fault, answer_length) {
        (Some(fault), Some(n)) if method == "GET" => {
            let mut body = vec![0u8; n];
            answer.read_exact(&mut body)?;
            match fault {
                Fault::Truncate => {
                    client.write_all(&rewrite_head(&head, None))?;
                    client.write_all(&body[..n / 2])?;
                    client.flush()?;
                    // Close without the rest: the client sees the body end early.
                    return client.shutdown(std::net::Shutdown::Both);
                }
                Fault::Short => {
                    client.write_all(&rewrite_head(&head, Some(n / 2)))?;
                    client.write_all(&body[..n / 2])?;
                }
                Fault::Corrupt => {
                    if n > 0 {
                        body[n / 2] ^= 0x10;
                    }
                    client.write_all(&rewrite_head(&head, None))?;
                    client.write_all(&body)?;
                }
                Fault::FlipDigitAfter(needle) => {
                    flip_digit_after(&mut body, needle.as_bytes());
                    client.write_all(&rewrite_head(&head, None))?;
                    client.write_all(&body)?;
                }
                Fault::Status(_) | Fault::Delay(_) | Fault::After(..) => {
                    unreachable!("handled above")
                }
            }
        }
        _ => {
            client.write_all(&rewrite_head(&head, None))?;
            std::io::copy(&mut answer, &mut client)?;
        }
    }
    client.flush()
}

/// Flips the lowest bit of the last digit of the first number after the first `needle` in
/// `body` ('0' <-> '1', '6' <-> '7', ...): the JSON stays well-formed (no leading zero appears),
/// only the number changes. False if there is no such number.
pub fn flip_digit_after(body: &mut [u8], needle: &[u8]) -> bool {
    let Some(at) = body.windows(needle.len()).position(|w| w == needle) else {
        return false;
    };
    let rest = at + needle.len();
    let Some(first) = body[rest..].iter().position(u8::is_ascii_digit) else {
        return false;
    };
    let start = rest + first;
    let len = body[start..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    body[start + len - 1] ^= 1;
    true
}

/// A tmpfs of `bytes` mounted on a new directory; unmounted (and the directory removed) when
/// dropped. Needs root: [`Tmpfs::mount`] returns `None` otherwise.
pub struct Tmpfs {
    dir: PathBuf,
    _parent: tempfile::TempDir,
}

impl Tmpfs {
    pub fn mount(bytes: u64) -> Option<Tmpfs> {
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let parent = tempfile::tempdir().expect("temp dir");
        let dir = parent.path().join("mnt");
        std::fs::create_dir(&dir).expect("mount point");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .status()
            .expect("mount runs");
        assert!(status.success(), "mounting a tmpfs on {}", dir.display());
        Some(Tmpfs {
            dir,
            _parent: parent,
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Bytes still free on the filesystem.
    pub fn available(&self) -> u64 {
        let out = std::process::Command::new("df")
            .args(["-B1", "--output=avail"])
            .arg(&self.dir)
            .output()
            .expect("df runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .expect("df prints the free bytes")
    }

    /// Writes `path` until the filesystem is full or `limit` bytes are written; returns the
    /// bytes written.
    pub fn fill(&self, path: &Path, limit: u64) -> u64 {
        let mut f = std::fs::File::create(path).expect("filler file");
        let chunk = vec![0u8; 4096];
        let mut written = 0u64;
        while written < limit {
            let n = chunk.len().min((limit - written) as usize);
            match f.write(&chunk[..n]) {
                Ok(0) => break,
                Ok(k) => written += k as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
        let _ = f.sync_all();
        written
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = std::process::Command::new("umount")
            .arg(&self.dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Something still holds a file there: detach it now, it goes when released.
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.dir)
                .status();
        }
    }
}
