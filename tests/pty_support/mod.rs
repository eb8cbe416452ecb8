//! A pseudo-terminal for a child's stderr, so tests see what a user at a terminal sees.
#![allow(dead_code)]

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};

/// Points `cmd`'s stderr at a new pseudo-terminal and returns the terminal's other end. Drop
/// `cmd` after spawning (it holds a copy of the child's end) so reading ends with the child.
pub fn stderr_on_terminal(cmd: &mut Command) -> std::fs::File {
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two new descriptors, owned below.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty");
    // SAFETY: fresh descriptors from openpty, owned by nothing else.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    cmd.stderr(Stdio::from(slave));
    std::fs::File::from(master)
}

/// Everything written to the terminal until its last writer is gone (then a read fails with
/// EIO, which ends it).
pub fn read_terminal(mut master: std::fs::File) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = master.read(&mut buf) {
        out.extend_from_slice(&buf[..n]);
    }
    out
}
