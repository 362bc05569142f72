//! Launching like every other trainer: one process per rank, started by `torchrun` or
//! `srun`, which meet at `MASTER_ADDR:MASTER_PORT`.
//!
//! [`LaunchEnv::from_vars`] reads the launcher's variables; [`TcpRanks::connect`] makes rank 0
//! listen at the master port and the others connect to it, each saying which rank of which
//! world it is (a mismatch is an error on both sides). The connections then carry the
//! [`Collective`]'s operations: a star through rank 0, which gathers every rank's bytes in
//! rank order and sends the whole back.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Collective, CollectiveError, wire};

/// The collective timeout when `ARES_COLLECTIVE_TIMEOUT` is not set: 10 minutes, NCCL's
/// watchdog default in PyTorch.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// A launch environment that cannot work, with what to set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LaunchError(pub String);

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `torchrun` (or anything that sets `RANK`/`WORLD_SIZE`/`LOCAL_RANK`).
    Torchrun,
    /// Slurm's `srun` (`SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`).
    Slurm,
}

/// This process's place among the ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Who set the variables.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// The rank on this machine (its GPU index).
    pub local_rank: usize,
    /// Where rank 0 listens (`None` for a world of 1).
    pub master: Option<(String, u16)>,
    /// How long an operation waits for the other ranks.
    pub timeout: Duration,
}

impl LaunchEnv {
    /// The launch environment of this process, read from its variables.
    ///
    /// # Errors
    /// As [`LaunchEnv::from_vars`].
    pub fn from_env() -> Result<Option<Self>, LaunchError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// The launch environment that `var` describes: `None` when no launcher variable is
    /// set (a plain single process). torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK` win over
    /// Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; a world of more than one
    /// needs `MASTER_ADDR` and `MASTER_PORT`. `ARES_COLLECTIVE_TIMEOUT` (seconds) bounds
    /// each collective wait.
    ///
    /// # Errors
    /// A variable missing, not a number or out of range, each named with what to set.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, LaunchError> {
        let torch = ["RANK", "WORLD_SIZE", "LOCAL_RANK"];
        let slurm = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"];
        let (launcher, names) = if torch.iter().any(|k| var(k).is_some()) {
            (Launcher::Torchrun, torch)
        } else if var("SLURM_PROCID").is_some() && var("SLURM_NTASKS").is_some() {
            (Launcher::Slurm, slurm)
        } else {
            return Ok(None);
        };
        let number = |k: &str| -> Result<usize, LaunchError> {
            let v = var(k).ok_or_else(|| {
                LaunchError(format!(
                    "{k} is not set while {} are: a {:?} launch sets all three ({})",
                    names
                        .iter()
                        .filter(|n| var(n).is_some())
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", "),
                    launcher,
                    names.join(", ")
                ))
            })?;
            v.trim()
                .parse()
                .map_err(|_| LaunchError(format!("{k}={v:?} is not a whole number")))
        };
        let (rank, world, local_rank) = (number(names[0])?, number(names[1])?, number(names[2])?);
        if world == 0 {
            return Err(LaunchError(format!(
                "{}=0: a world needs at least one rank",
                names[1]
            )));
        }
        if rank >= world {
            return Err(LaunchError(format!(
                "{}={rank} but {}={world}: ranks run from 0 to {}",
                names[0],
                names[1],
                world - 1
            )));
        }
        let timeout = match var("ARES_COLLECTIVE_TIMEOUT") {
            None => DEFAULT_TIMEOUT,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(s) if s > 0 => Duration::from_secs(s),
                _ => {
                    return Err(LaunchError(format!(
                        "ARES_COLLECTIVE_TIMEOUT={v:?}: give a whole number of seconds > 0"
                    )));
                }
            },
        };
        let master = if world == 1 {
            None
        } else {
            let addr = var("MASTER_ADDR").filter(|a| !a.trim().is_empty()).ok_or_else(|| {
                LaunchError(format!(
                    "MASTER_ADDR is not set: {world} ranks meet at rank 0's host; torchrun sets \
                     it, with srun export MASTER_ADDR=$(scontrol show hostnames \
                     \"$SLURM_JOB_NODELIST\" | head -n 1)"
                ))
            })?;
            let port = var("MASTER_PORT").ok_or_else(|| {
                LaunchError(
                    "MASTER_PORT is not set: the port rank 0 listens on (any free port, the \
                     same for every rank, e.g. export MASTER_PORT=29500)"
                        .into(),
                )
            })?;
            let port: u16 = port.trim().parse().ok().filter(|&p| p > 0).ok_or_else(|| {
                LaunchError(format!("MASTER_PORT={port:?} is not a port (1–65535)"))
            })?;
            Some((addr.trim().to_string(), port))
        };
        Ok(Some(Self {
            launcher,
            rank,
            world,
            local_rank,
            master,
            timeout,
        }))
    }

    /// Checks that `LOCAL_RANK` names one of the `devices` this process sees.
    ///
    /// # Errors
    /// A local rank out of range, with what to change.
    pub fn check_device(&self, devices: usize) -> Result<(), LaunchError> {
        if self.local_rank < devices {
            return Ok(());
        }
        let var = match self.launcher {
            Launcher::Torchrun => "LOCAL_RANK",
            Launcher::Slurm => "SLURM_LOCALID",
        };
        Err(LaunchError(format!(
            "{var}={} but this process sees {devices} GPU(s) (CUDA_VISIBLE_DEVICES limits them): \
             start at most {devices} ranks per machine (torchrun --nproc-per-node {devices}, \
             srun --ntasks-per-node {devices})",
            self.local_rank
        )))
    }
}

/// Ranks in separate processes, connected over TCP through rank 0.
#[derive(Debug)]
pub struct TcpRanks {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Operations so far, and the connections — rank 0: each other rank's (index
    /// r − 1); another rank: rank 0's.
    links: Mutex<(u64, Vec<TcpStream>)>,
}

const MAGIC: &[u8; 8] = b"ARES-DP1";

impl TcpRanks {
    /// Meets the other ranks of `env` (rank 0 listens at its `MASTER_PORT`; the others
    /// connect to `MASTER_ADDR:MASTER_PORT`, retrying until the timeout).
    ///
    /// # Errors
    /// The port is taken, rank 0 cannot be reached in time, or a rank reports another
    /// world size or a rank twice.
    pub fn connect(env: &LaunchEnv) -> Result<Self, CollectiveError> {
        let (rank, world, timeout) = (env.rank, env.world, env.timeout);
        let fail = |what: String| CollectiveError::Transport { rank, what };
        let Some((addr, port)) = &env.master else {
            return Ok(Self {
                rank,
                world,
                timeout,
                links: Mutex::new((0, Vec::new())),
            });
        };
        let deadline = Instant::now() + timeout;
        if rank == 0 {
            let listener = TcpListener::bind(("0.0.0.0", *port)).map_err(|e| {
                fail(format!(
                    "cannot listen on port {port} (MASTER_PORT): {e}; pick a free port"
                ))
            })?;
            listener
                .set_nonblocking(true)
                .map_err(|e| fail(format!("listener: {e}")))?;
            let mut links: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
            while links.iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((mut s, from)) => {
                        s.set_nonblocking(false).map_err(|e| fail(e.to_string()))?;
                        // every frame is one write and waits for its answer: Nagle's
                        // algorithm would only delay it
                        s.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
                        // a greeting is 24 bytes within a few seconds: whatever else
                        // connects (a port scanner, another program) is dropped, and rank
                        // 0 goes on waiting for its ranks
                        s.set_read_timeout(Some(Duration::from_secs(10)))
                            .map_err(|e| fail(e.to_string()))?;
                        let hello = read_frame_at_most(&mut s, 64)
                            .map_err(|e| e.to_string())
                            .and_then(|h| parse_hello(&h));
                        let (peer, peer_world) = match hello {
                            Ok(h) => h,
                            Err(e) => {
                                eprintln!("warning: rank 0: dropped a connection from {from}: {e}");
                                continue;
                            }
                        };
                        s.set_read_timeout(Some(timeout))
                            .map_err(|e| fail(e.to_string()))?;
                        let problem = if peer_world != world {
                            Some(format!(
                                "rank {peer} says the world has {peer_world} ranks, rank 0 says {world}: \
                                 start every rank with the same WORLD_SIZE"
                            ))
                        } else if peer == 0 || peer >= world {
                            Some(format!("a rank says it is rank {peer} of {world}"))
                        } else if links[peer - 1].is_some() {
                            Some(format!("two processes say they are rank {peer}"))
                        } else {
                            None
                        };
                        if let Some(p) = problem {
                            let _ = write_frame(&mut s, format!("refused: {p}").as_bytes());
                            return Err(CollectiveError::Mismatch { rank, what: p });
                        }
                        write_frame(&mut s, b"ok").map_err(|e| fail(e.to_string()))?;
                        links[peer - 1] = Some(s);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            let missing: Vec<usize> =
                                (1..world).filter(|&r| links[r - 1].is_none()).collect();
                            return Err(CollectiveError::Timeout {
                                rank,
                                round: 0,
                                secs: timeout.as_secs(),
                                missing,
                            });
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(fail(format!("accepting a rank: {e}"))),
                }
            }
            return Ok(Self {
                rank,
                world,
                timeout,
                links: Mutex::new((0, links.into_iter().flatten().collect())),
            });
        }
        let target = format!("{addr}:{port}");
        let mut stream = loop {
            let resolved = target.to_socket_addrs().map_err(|e| {
                fail(format!(
                    "MASTER_ADDR:MASTER_PORT = {target} does not resolve: {e}"
                ))
            })?;
            // rank 0 may not listen yet: retry until the timeout
            let connected = resolved
                .into_iter()
                .find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok());
            match connected {
                Some(s) => break s,
                None if Instant::now() >= deadline => {
                    return Err(CollectiveError::Timeout {
                        rank,
                        round: 0,
                        secs: timeout.as_secs(),
                        missing: vec![0],
                    });
                }
                None => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| fail(e.to_string()))?;
        stream.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&(rank as u64).to_le_bytes());
        hello.extend_from_slice(&(world as u64).to_le_bytes());
        write_frame(&mut stream, &hello).map_err(|e| fail(format!("greeting rank 0: {e}")))?;
        let reply = read_frame(&mut stream).map_err(|e| fail(format!("rank 0's answer: {e}")))?;
        if reply != b"ok" {
            return Err(CollectiveError::Mismatch {
                rank,
                what: format!("rank 0 {}", String::from_utf8_lossy(&reply)),
            });
        }
        Ok(Self {
            rank,
            world,
            timeout,
            links: Mutex::new((0, vec![stream])),
        })
    }
}

fn parse_hello(b: &[u8]) -> Result<(usize, usize), String> {
    if b.len() != 24 || &b[..8] != MAGIC {
        return Err("a connection to the master port that is not an ares rank".into());
    }
    let n = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes")) as usize;
    Ok((n(&b[8..16]), n(&b[16..24])))
}

/// Writes `bytes` after their length, in one write: a length sent alone would wait for
/// the peer's delayed acknowledgement before the bytes could follow.
fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(8 + bytes.len());
    frame.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    frame.extend_from_slice(bytes);
    s.write_all(&frame)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    read_frame_at_most(s, usize::MAX)
}

fn read_frame_at_most(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = usize::try_from(u64::from_le_bytes(len))
        .ok()
        .filter(|&n| n <= max)
        .ok_or_else(|| std::io::Error::other(format!("a frame longer than {max} bytes")))?;
    let mut out = Vec::new();
    // grow as bytes arrive: a corrupt length cannot allocate what never comes
    s.take(len as u64).read_to_end(&mut out)?;
    if out.len() != len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed mid-message",
        ));
    }
    Ok(out)
}

impl Collective for TcpRanks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let rank = self.rank;
        self.exchange(
            mine,
            |all| {
                let msg = encode(&all.iter().map(Vec::as_slice).collect::<Vec<_>>());
                (Ok(all), Some(Replies::Same(msg)))
            },
            |msg| split(rank, self.world, msg),
        )
    }

    /// Routed through rank 0: each rank receives its own parts only.
    fn all_to_all(&self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let (rank, world) = (self.rank, self.world);
        if parts.len() != world {
            return Err(CollectiveError::Mismatch {
                rank,
                what: format!("all_to_all: {} parts for {world} ranks", parts.len()),
            });
        }
        self.exchange(
            encode(&parts.iter().map(Vec::as_slice).collect::<Vec<_>>()),
            |all| {
                // every rank's parts, then each destination's column
                let parts: Vec<Vec<Vec<u8>>> =
                    match all.iter().map(|b| split(rank, world, b)).collect() {
                        Ok(p) => p,
                        Err(e) => return (Err(e), None),
                    };
                let column = |d: usize| parts.iter().map(|p| p[d].as_slice()).collect::<Vec<_>>();
                let replies = (1..world).map(|d| encode(&column(d))).collect();
                let mine = parts.iter().map(|p| p[0].clone()).collect();
                (Ok(mine), Some(Replies::Each(replies)))
            },
            |msg| split(rank, world, msg),
        )
    }

    /// Summed at rank 0, which sends each rank the sum alone (not every rank's parts).
    fn ordered_sum(&self, message: Vec<u8>, len: usize) -> Result<Vec<f32>, CollectiveError> {
        let rank = self.rank;
        self.exchange(
            message,
            |all| {
                let mut sum = vec![0.0f32; len];
                let mut w = wire::Writer::default();
                // a failure reaches every rank, so none waits for a sum that never comes
                let folded = super::fold_parts(0, &all, &mut sum);
                match &folded {
                    Ok(()) => {
                        w.u8(0);
                        w.values(&sum);
                    }
                    Err(e) => {
                        w.u8(1);
                        w.bytes(e.to_string().as_bytes());
                    }
                }
                (folded.map(|()| sum), Some(Replies::Same(w.finish())))
            },
            |msg| {
                let mut r = wire::Reader::new(msg);
                let bad = |e: wire::WireError| e.at(rank);
                if r.u8().map_err(bad)? != 0 {
                    let why = String::from_utf8_lossy(r.bytes().map_err(bad)?).into_owned();
                    return Err(CollectiveError::Transport {
                        rank,
                        what: format!("rank 0 could not sum: {why}"),
                    });
                }
                let sum = r.values(len).map_err(|e| CollectiveError::Mismatch {
                    rank,
                    what: format!("the sum from rank 0: {e}"),
                })?;
                r.end().map_err(bad)?;
                Ok(sum.to_vec())
            },
        )
    }
}

/// What rank 0 sends back after an operation: one message for every rank, or each rank's
/// own (ranks 1, 2, …).
enum Replies {
    Same(Vec<u8>),
    Each(Vec<Vec<u8>>),
}

/// `parts` as one message (each part's length, then its bytes).
fn encode(parts: &[&[u8]]) -> Vec<u8> {
    let mut w = wire::Writer::default();
    for b in parts {
        w.bytes(b);
    }
    w.finish()
}

/// A message of [`encode`] holding `world` parts, split (`rank` names the reader).
fn split(rank: usize, world: usize, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
    let mut r = wire::Reader::new(bytes);
    let parts = (0..world)
        .map(|_| r.bytes().map(<[u8]>::to_vec))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.at(rank))?;
    r.end().map_err(|e| e.at(rank))?;
    Ok(parts)
}

impl TcpRanks {
    /// One operation through rank 0: every rank sends `mine`; rank 0 makes its own result
    /// and the replies from every rank's bytes, in rank order (`at_root`; no replies: the
    /// others are left to their timeout), and each other rank reads its reply (`decode`).
    fn exchange<T>(
        &self,
        mine: Vec<u8>,
        at_root: impl FnOnce(Vec<Vec<u8>>) -> (Result<T, CollectiveError>, Option<Replies>),
        decode: impl FnOnce(&[u8]) -> Result<T, CollectiveError>,
    ) -> Result<T, CollectiveError> {
        let rank = self.rank;
        let mut guard = self
            .links
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (round, links) = &mut *guard;
        *round += 1;
        let round = *round - 1;
        let lost = |gone: usize, e: std::io::Error| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                CollectiveError::Timeout {
                    rank,
                    round,
                    secs: self.timeout.as_secs(),
                    missing: vec![gone],
                }
            } else {
                let why = match e.kind() {
                    std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe => {
                        "its connection closed (the process ended, failed or was killed; its own \
                         output says why)"
                            .to_string()
                    }
                    _ => format!("its connection failed: {e}"),
                };
                CollectiveError::RankGone {
                    rank,
                    gone,
                    round,
                    why,
                }
            }
        };
        if rank == 0 {
            let mut all = vec![mine];
            for (i, s) in links.iter_mut().enumerate() {
                all.push(read_frame(s).map_err(|e| lost(i + 1, e))?);
            }
            let (result, replies) = at_root(all);
            match replies {
                Some(Replies::Same(msg)) => {
                    for (i, s) in links.iter_mut().enumerate() {
                        write_frame(s, &msg).map_err(|e| lost(i + 1, e))?;
                    }
                }
                Some(Replies::Each(msgs)) => {
                    for (i, (s, msg)) in links.iter_mut().zip(&msgs).enumerate() {
                        write_frame(s, msg).map_err(|e| lost(i + 1, e))?;
                    }
                }
                None => {}
            }
            return result;
        }
        let s = &mut links[0];
        write_frame(s, &mine).map_err(|e| lost(0, e))?;
        let msg = read_frame(s).map_err(|e| lost(0, e))?;
        decode(&msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>, LaunchError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_and_slurm_variables_are_read() {
        assert_eq!(env(&[]).unwrap(), None);
        let t = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (t.launcher, t.rank, t.world, t.local_rank),
            (Launcher::Torchrun, 3, 8, 3)
        );
        assert_eq!(t.master, Some(("node0".into(), 29500)));
        assert_eq!(t.timeout, DEFAULT_TIMEOUT);
        let s = env(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("ARES_COLLECTIVE_TIMEOUT", "30"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.launcher, s.rank, s.world, s.local_rank),
            (Launcher::Slurm, 9, 16, 1)
        );
        assert_eq!(s.timeout, Duration::from_secs(30));
        // a world of one needs no master
        let one = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")])
            .unwrap()
            .unwrap();
        assert_eq!(one.master, None);
    }

    #[test]
    fn bad_launch_environments_say_what_to_set() {
        let e = |pairs: &[(&str, &str)]| env(pairs).unwrap_err().to_string();
        let base = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")];
        assert!(e(&base).contains("MASTER_ADDR is not set"), "{}", e(&base));
        let mut v = base.to_vec();
        v.push(("MASTER_ADDR", "h"));
        assert!(e(&v).contains("MASTER_PORT is not set"));
        v.push(("MASTER_PORT", "http"));
        assert!(e(&v).contains("MASTER_PORT=\"http\""));
        let msg = e(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
        assert!(msg.contains("RANK=2 but WORLD_SIZE=2"), "{msg}");
        let msg = e(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(msg.contains("LOCAL_RANK is not set"), "{msg}");
        assert!(
            e(&[("RANK", "x"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]).contains("RANK=\"x\"")
        );
        assert!(
            e(&[("RANK", "0"), ("WORLD_SIZE", "0"), ("LOCAL_RANK", "0")]).contains("WORLD_SIZE=0")
        );
        let one = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "2")])
            .unwrap()
            .unwrap();
        let msg = one.check_device(2).unwrap_err().to_string();
        assert!(
            msg.contains("LOCAL_RANK=2 but this process sees 2 GPU(s)"),
            "{msg}"
        );
        one.check_device(3).unwrap();
    }

    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn launch(rank: usize, world: usize, port: u16) -> LaunchEnv {
        LaunchEnv {
            launcher: Launcher::Torchrun,
            rank,
            world,
            local_rank: rank,
            master: Some(("127.0.0.1".into(), port)),
            timeout: Duration::from_secs(20),
        }
    }

    #[test]
    fn ranks_over_tcp_gather_in_rank_order() {
        let port = free_port();
        let out: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    s.spawn(move || {
                        let c = TcpRanks::connect(&launch(r, 3, port)).unwrap();
                        let mut last = Vec::new();
                        for k in 0..20u8 {
                            last = c.all_gather(vec![r as u8; usize::from(k) + r]).unwrap();
                        }
                        last
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want = vec![vec![0u8; 19], vec![1u8; 20], vec![2u8; 21]];
        assert!(out.iter().all(|o| o == &want));
    }

    /// `all_to_all` routed through rank 0: rank `s` receives part `s` of every rank, in
    /// rank order, interleaved with gathers; a wrong part count is an error.
    #[test]
    fn ranks_over_tcp_route_each_part_to_its_rank() {
        let port = free_port();
        let out: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    s.spawn(move || {
                        let c = TcpRanks::connect(&launch(r, 3, port)).unwrap();
                        let mut last = Vec::new();
                        for k in 0..5u8 {
                            let parts = (0..3)
                                .map(|d| vec![10 * r as u8 + d as u8; usize::from(k) + d])
                                .collect();
                            last = c.all_to_all(parts).unwrap();
                            assert_eq!(c.all_gather(vec![k]).unwrap(), vec![vec![k]; 3]);
                        }
                        assert!(c.all_to_all(vec![vec![]]).is_err());
                        last
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (d, got) in out.iter().enumerate() {
            let want: Vec<Vec<u8>> = (0..3)
                .map(|r| vec![10 * r as u8 + d as u8; 4 + d])
                .collect();
            assert_eq!(got, &want, "rank {d}");
        }
    }

    /// Ordered sums through rank 0: every rank gets the bits of adding every rank's parts in
    /// rank then part order (values whose sum depends on that order); interleaved with
    /// gathers.
    #[test]
    fn ranks_over_tcp_sum_in_rank_order_at_rank_0() {
        let port = free_port();
        let parts = |r: usize| -> Vec<Vec<f32>> {
            let pair: [f32; 2] = [[1e8, 1.0], [-1e8, 1.0], [0.5, 0.25]][r];
            pair.iter()
                .map(|&x| (0..5).map(|i| x * (i + 1) as f32).collect())
                .collect()
        };
        // the parts added in `order`, element by element
        let fold = |order: &[usize]| -> Vec<f32> {
            let all: Vec<Vec<f32>> = order.iter().flat_map(|&r| parts(r)).collect();
            (0..5)
                .map(|i| all.iter().skip(1).fold(all[0][i], |acc, p| acc + p[i]))
                .collect()
        };
        let want = fold(&[0, 1, 2]);
        assert_ne!(want, fold(&[2, 1, 0]), "the values do not test the order");
        let out: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    s.spawn(move || {
                        let ranks = crate::parallel::Ranks::new(std::sync::Arc::new(
                            TcpRanks::connect(&launch(r, 3, port)).unwrap(),
                        ));
                        let mut sum = vec![0.0f32; 5];
                        ranks.ordered_sum(&parts(r), &mut sum).unwrap();
                        assert_eq!(ranks.all_gather(vec![r as u8]).unwrap().len(), 3);
                        sum
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, got) in out.iter().enumerate() {
            assert_eq!(bits(got), bits(&want), "rank {r}");
        }
    }

    #[test]
    fn a_stranger_on_the_port_is_dropped_and_the_ranks_still_meet() {
        let port = free_port();
        let out = std::thread::scope(|s| {
            let r0 = s.spawn(move || TcpRanks::connect(&launch(0, 2, port)));
            // something that is not a rank connects first and sends garbage
            let mut stranger = loop {
                if let Ok(c) = TcpStream::connect(("127.0.0.1", port)) {
                    break c;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            stranger.write_all(&u64::MAX.to_le_bytes()).unwrap();
            let r1 = s.spawn(move || TcpRanks::connect(&launch(1, 2, port)));
            let (a, b) = (r0.join().unwrap().unwrap(), r1.join().unwrap().unwrap());
            let (x, y) = std::thread::scope(|s| {
                let x = s.spawn(|| a.all_gather(vec![7]));
                let y = s.spawn(|| b.all_gather(vec![8]));
                (x.join().unwrap().unwrap(), y.join().unwrap().unwrap())
            });
            (x, y)
        });
        assert_eq!(out.0, vec![vec![7], vec![8]]);
        assert_eq!(out.1, out.0);
    }

    #[test]
    fn a_rank_that_ends_is_named_by_the_others() {
        let port = free_port();
        let (r0, r1) = std::thread::scope(|s| {
            let a = s.spawn(move || TcpRanks::connect(&launch(0, 2, port)).unwrap());
            let b = s.spawn(move || TcpRanks::connect(&launch(1, 2, port)).unwrap());
            (a.join().unwrap(), b.join().unwrap())
        });
        drop(r1);
        let e = r0.all_gather(vec![1]).unwrap_err();
        assert!(
            matches!(e, CollectiveError::RankGone { gone: 1, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("connection closed"), "{e}");
    }

    #[test]
    fn a_rank_with_another_world_size_is_refused() {
        let port = free_port();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(move || TcpRanks::connect(&launch(0, 2, port)).map(|_| ()));
            let b = s.spawn(move || TcpRanks::connect(&launch(1, 3, port)).map(|_| ()));
            (a.join().unwrap(), b.join().unwrap())
        });
        let (a, b) = (a.unwrap_err().to_string(), b.unwrap_err().to_string());
        assert!(
            a.contains("rank 1 says the world has 3 ranks, rank 0 says 2"),
            "{a}"
        );
        assert!(
            b.contains("refused") && b.contains("same WORLD_SIZE"),
            "{b}"
        );
    }
}
