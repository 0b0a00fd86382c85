//! Unix seqpacket sockets with fd passing and doorbell checks: the setup
//! path of the shared-memory backend (the only place the kernel is involved
//! once a channel runs), on top of rustix's safe wrappers.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec};

use crate::wake::wait_readable;
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

/// Most fds one message carries.
pub(crate) const MAX_FDS: usize = 4;

/// Where a shared-memory endpoint listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnixName {
    /// A socket file.
    Path(PathBuf),
    /// A Linux abstract socket name (no file; gone with the listener).
    Abstract(Vec<u8>),
}

impl UnixName {
    fn addr(&self) -> io::Result<SocketAddrUnix> {
        Ok(match self {
            UnixName::Path(p) => SocketAddrUnix::new(p.as_path())?,
            UnixName::Abstract(n) => SocketAddrUnix::new_abstract_name(n)?,
        })
    }
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?)
}

/// A listening socket; removes its socket file on drop.
#[derive(Debug)]
pub(crate) struct Listener {
    fd: OwnedFd,
    path: Option<PathBuf>,
}

impl Listener {
    /// Listen on `name`. A socket file nobody listens on any more (left by a
    /// crashed process) is replaced; a live one gives `AddrInUse`.
    pub(crate) fn bind(name: &UnixName) -> io::Result<Listener> {
        let fd = seqpacket()?;
        let addr = name.addr()?;
        match rustix::net::bind(&fd, &addr) {
            Ok(()) => {}
            Err(Errno::ADDRINUSE) => match name {
                // Nobody listens on a stale file; a live listener whose
                // queue is full is still live.
                UnixName::Path(p)
                    if Conn::connect(name, Duration::from_secs(1))
                        .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionRefused) =>
                {
                    std::fs::remove_file(p)?;
                    rustix::net::bind(&fd, &addr)?;
                }
                _ => return Err(io::ErrorKind::AddrInUse.into()),
            },
            Err(e) => return Err(e.into()),
        }
        rustix::net::listen(&fd, 16)?;
        set_nonblocking(&fd)?;
        let path = match name {
            UnixName::Path(p) => Some(p.clone()),
            UnixName::Abstract(_) => None,
        };
        Ok(Listener { fd, path })
    }

    /// Accept a connection if one is waiting.
    pub(crate) fn accept(&self) -> io::Result<Option<Conn>> {
        match rustix::net::accept_with(&self.fd, SocketFlags::CLOEXEC) {
            Ok(fd) => Ok(Some(Conn { fd })),
            Err(Errno::AGAIN) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(fd)?;
    rustix::fs::fcntl_setfl(fd, flags | rustix::fs::OFlags::NONBLOCK)?;
    Ok(())
}

/// A connected seqpacket socket (message boundaries kept, fds passed).
#[derive(Debug)]
pub(crate) struct Conn {
    fd: OwnedFd,
}

impl Conn {
    /// Connect to `name`, waiting at most `timeout` for the listener's
    /// queue to take us (`TimedOut` past it).
    pub(crate) fn connect(name: &UnixName, timeout: Duration) -> io::Result<Conn> {
        use rustix::net::sockopt::{set_socket_timeout, Timeout};
        let fd = seqpacket()?;
        // A connect to a listener whose queue is full waits up to the send
        // timeout (and so does a send to a peer that reads nothing).
        set_socket_timeout(&fd, Timeout::Send, Some(timeout.max(Duration::from_millis(1))))?;
        match rustix::net::connect(&fd, &name.addr()?) {
            Ok(()) => Ok(Conn { fd }),
            Err(Errno::AGAIN) => Err(io::ErrorKind::TimedOut.into()),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends block without bound again (the setup is over).
    pub(crate) fn clear_send_timeout(&self) -> io::Result<()> {
        use rustix::net::sockopt::{set_socket_timeout, Timeout};
        Ok(set_socket_timeout(&self.fd, Timeout::Send, None)?)
    }

    /// Send one message with up to [`MAX_FDS`] fds.
    pub(crate) fn send(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let n = rustix::net::sendmsg(&self.fd, &[io::IoSlice::new(data)], &mut control, SendFlags::NOSIGNAL)?;
        if n != data.len() {
            return Err(io::ErrorKind::WriteZero.into());
        }
        Ok(())
    }

    /// Receive one message: `Ok(None)` if none arrives within `timeout`
    /// (`Some(ZERO)`: do not wait); `Ok(Some((0, _)))` means the peer closed.
    /// Fds beyond [`MAX_FDS`] are closed by the kernel (MSG_CTRUNC).
    pub(crate) fn recv(&self, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
        if !wait_readable(&[self.fd.as_fd()], timeout)? {
            return Ok(None);
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = match rustix::net::recvmsg(
            &self.fd,
            &mut [io::IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        ) {
            Ok(m) => m,
            Err(Errno::AGAIN) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        if msg.flags.contains(rustix::net::ReturnFlags::TRUNC) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "setup message too long"));
        }
        Ok(Some((msg.bytes, fds)))
    }

    /// The peer process's pid (SO_PEERCRED, fixed at connect time).
    pub(crate) fn peer_pid(&self) -> io::Result<rustix::process::Pid> {
        let cred = rustix::net::sockopt::socket_peercred(&self.fd)?;
        Ok(cred.pid)
    }

    /// Whether the peer hung up (without waiting).
    pub(crate) fn hung_up(&self) -> bool {
        let mut pfd = [PollFd::new(&self.fd, PollFlags::IN)];
        match rustix::event::poll(&mut pfd, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })) {
            Ok(0) => false,
            Ok(_) => pfd[0].revents().intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::RDHUP),
            Err(_) => true,
        }
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Accept a doorbell from the peer only if it is an eventfd, and make it
/// non-blocking (the peer's flags are its own business; ours must never
/// block): a pipe the peer keeps full, a socket or a regular file would let
/// the peer stall or fool every ring. An eventfd whose counter the peer
/// keeps near its maximum makes our write fail with `EAGAIN`, never wait.
pub(crate) fn check_doorbell(fd: &OwnedFd) -> Result<(), String> {
    let kind = crate::sys::fd_kind(fd.as_fd()).map_err(|e| format!("doorbell: cannot tell its kind ({e})"))?;
    if kind.as_os_str() != "anon_inode:[eventfd]" {
        return Err(format!("doorbell is not an eventfd but {}", kind.display()));
    }
    set_nonblocking(fd).map_err(|e| format!("doorbell: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fds_travel_with_messages() {
        let name = UnixName::Abstract(format!("ferry-uds-test-{}", std::process::id()).into_bytes());
        let l = Listener::bind(&name).unwrap();
        assert_eq!(Listener::bind(&name).unwrap_err().kind(), io::ErrorKind::AddrInUse);
        let c = Conn::connect(&name, Duration::from_secs(5)).unwrap();
        let s = loop {
            if let Some(s) = l.accept().unwrap() {
                break s;
            }
        };
        let bell = crate::wake::eventfd().unwrap();
        c.send(b"hello", &[bell.as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = s.recv(&mut buf, Some(Duration::from_secs(5))).unwrap().unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"hello"[..], 1));
        // The received fd is the same eventfd.
        crate::wake::ring(&bell);
        assert!(wait_readable(&[fds[0].as_fd()], Some(Duration::from_secs(5))).unwrap());
        assert_eq!(s.peer_pid().unwrap(), rustix::process::getpid());
        assert!(!s.hung_up());
        drop(c);
        assert!(s.hung_up());
        let (n, _) = s.recv(&mut buf, Some(Duration::from_secs(5))).unwrap().unwrap();
        assert_eq!(n, 0, "EOF after the peer closed");
    }

    #[test]
    fn doorbells_must_be_eventfds_and_are_rung_without_waiting() {
        let (_r, w) = rustix::pipe::pipe().unwrap();
        assert!(check_doorbell(&w).unwrap_err().contains("pipe"));
        // A blocking eventfd one short of its maximum: a blocking write of
        // 1 would wait for a reader that never comes.
        let bell = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        rustix::io::write(&bell, &(u64::MAX - 1).to_ne_bytes()).unwrap();
        check_doorbell(&bell).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            crate::wake::ring(&bell);
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("the ring returned at once");
    }

    #[test]
    fn stale_socket_files_are_replaced() {
        let dir = std::env::temp_dir().join(format!("ferry-uds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let name = UnixName::Path(dir.join("ep.sock"));
        let mut l = Listener::bind(&name).unwrap();
        // Close the socket but leave its file, as a crashed process would.
        l.path = None;
        drop(l);
        let l2 = Listener::bind(&name).expect("stale file replaced");
        drop(l2);
        assert!(!dir.join("ep.sock").exists(), "file removed with the listener");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
