//! Threads as ranks: a [`Collective`] inside one process, for tests and for CPU runs
//! that want the data-parallel code path without a launcher.
//!
//! Operation `k` of every rank meets in one slot: each rank deposits its bytes; the last
//! to arrive publishes them (in rank order) and wakes the others. A rank that waits
//! longer than the group's timeout, or sees that a missing rank has dropped its handle,
//! gets an error naming the ranks it waited for.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Collective, CollectiveError};

/// The ranks' meeting place.
#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    wake: Condvar,
}

/// An operation's gathered bytes.
type Gathered = Arc<Vec<Vec<u8>>>;

#[derive(Debug, Default)]
struct State {
    /// Deposits of operations not yet complete, by operation number.
    pending: HashMap<u64, Vec<Option<Vec<u8>>>>,
    /// Completed operations: the gathered bytes and how many ranks have yet to read them.
    done: HashMap<u64, (Gathered, usize)>,
    /// Ranks whose handle was dropped: after how many operations, and why.
    gone: HashMap<usize, (u64, String)>,
}

/// Makes the ranks of one in-process group.
#[derive(Debug)]
pub struct ThreadGroup;

impl ThreadGroup {
    /// `world` ranks (handles `0..world`, one per thread) whose operations wait at most
    /// `timeout` for each other.
    ///
    /// # Panics
    /// Never; a world of 0 gives no rank.
    pub fn ranks(world: usize, timeout: Duration) -> Vec<ThreadRank> {
        let shared = Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadRank {
                shared: Arc::clone(&shared),
                rank,
                round: Mutex::new(0),
                why_gone: Mutex::new(None),
            })
            .collect()
    }
}

/// One rank of a [`ThreadGroup`]. Dropping it tells the others it is gone.
#[derive(Debug)]
pub struct ThreadRank {
    shared: Arc<Shared>,
    rank: usize,
    /// Operations this rank has entered.
    round: Mutex<u64>,
    /// Set by [`ThreadRank::fail`]: reported to the others when this rank is dropped.
    why_gone: Mutex<Option<String>>,
}

impl ThreadRank {
    /// Records why this rank is stopping (its error), for the others' messages.
    pub fn fail(&self, why: impl Into<String>) {
        *lock(&self.why_gone) = Some(why.into());
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // a rank that panicked while holding the lock left consistent data (every update is
    // a single insert or remove), so the others go on and report it as gone
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let round = *lock(&self.round);
        let why = lock(&self.why_gone)
            .take()
            .unwrap_or_else(|| "its handle was dropped (the rank ended or panicked)".into());
        lock(&self.shared.state)
            .gone
            .insert(self.rank, (round, why));
        self.shared.wake.notify_all();
    }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let (world, rank) = (self.shared.world, self.rank);
        let round = {
            let mut r = lock(&self.round);
            *r += 1;
            *r - 1
        };
        let mut st = lock(&self.shared.state);
        let slots = st.pending.entry(round).or_insert_with(|| vec![None; world]);
        slots[rank] = Some(mine);
        if slots.iter().all(Option::is_some) {
            let slots = st.pending.remove(&round).unwrap_or_default();
            let all: Vec<Vec<u8>> = slots.into_iter().map(Option::unwrap_or_default).collect();
            st.done.insert(round, (Arc::new(all), world));
            self.shared.wake.notify_all();
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if let Some((all, readers)) = st.done.get_mut(&round) {
                let all = Arc::clone(all);
                *readers -= 1;
                if *readers == 0 {
                    st.done.remove(&round);
                }
                return Ok(Arc::try_unwrap(all).unwrap_or_else(|a| (*a).clone()));
            }
            let missing: Vec<usize> = st
                .pending
                .get(&round)
                .map(|s| (0..world).filter(|&r| s[r].is_none()).collect())
                .unwrap_or_default();
            // a missing rank that is gone will never come
            if let Some((&gone, (_, why))) = st
                .gone
                .iter()
                .filter(|(g, _)| missing.contains(g))
                .min_by_key(|(g, _)| **g)
            {
                return Err(CollectiveError::RankGone {
                    rank,
                    gone,
                    round,
                    why: why.clone(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CollectiveError::Timeout {
                    rank,
                    round,
                    secs: self.shared.timeout.as_secs(),
                    missing,
                });
            }
            st = self
                .shared
                .wake
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Ranks;
    use super::*;

    fn group(world: usize) -> Vec<Ranks> {
        ThreadGroup::ranks(world, Duration::from_secs(20))
            .into_iter()
            .map(|r| Ranks::new(Arc::new(r)))
            .collect()
    }

    #[test]
    fn gathers_in_rank_order_over_many_rounds() {
        let out: Vec<Vec<Vec<Vec<u8>>>> = std::thread::scope(|s| {
            let handles: Vec<_> = group(3)
                .into_iter()
                .map(|r| {
                    s.spawn(move || {
                        (0..50u8)
                            .map(|k| r.all_gather(vec![r.rank() as u8, k]).unwrap())
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for per_rank in &out {
            for (k, all) in per_rank.iter().enumerate() {
                assert_eq!(
                    all,
                    &vec![vec![0, k as u8], vec![1, k as u8], vec![2, k as u8]]
                );
            }
        }
    }

    #[test]
    fn units_and_ordered_sums_do_not_depend_on_the_world() {
        let values = |i: usize| -> Vec<f32> {
            (0..5)
                .map(|j| 1.0 / (1.0 + (i * 7 + j) as f32) * 1e3f32.powi(i as i32 % 3))
                .collect()
        };
        let run = |world: usize| -> (Vec<Vec<u8>>, Vec<u32>) {
            std::thread::scope(|s| {
                let handles: Vec<_> = group(world)
                    .into_iter()
                    .map(|r| {
                        s.spawn(move || {
                            let units = r
                                .map_units(7, |i| Ok::<_, String>(vec![i as u8; i]))
                                .unwrap();
                            let mine: Vec<Vec<f32>> = (0..7)
                                .filter(|&i| r.owner(i, 7) == r.rank())
                                .map(values)
                                .collect();
                            let mut out = vec![0.0; 5];
                            r.ordered_sum(&mine, &mut out).unwrap();
                            (units, out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
                        })
                    })
                    .collect();
                let all: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
                assert!(all.windows(2).all(|w| w[0] == w[1]), "ranks disagree");
                all.into_iter().next().unwrap()
            })
        };
        let one = run(1);
        let mut serial = values(0);
        for i in 1..7 {
            for (o, v) in serial.iter_mut().zip(values(i)) {
                *o += v;
            }
        }
        assert_eq!(
            one.1,
            serial.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(one.0, (0..7).map(|i| vec![i as u8; i]).collect::<Vec<_>>());
        for world in [2, 3, 4, 7, 9] {
            assert_eq!(run(world), one, "world {world}");
        }
    }

    /// The reduce-scatter: each rank's held spans are `ordered_sum`'s bits, the rest 0,
    /// whatever the world; spans held by every rank reach every rank.
    #[test]
    fn held_sums_are_the_ordered_sums_of_each_ranks_spans() {
        use super::super::Holder;
        let values = |i: usize| -> Vec<f32> {
            (0..9)
                .map(|j| 1.0 / (1.0 + (i * 5 + j) as f32) * 1e3f32.powi(i as i32 % 3))
                .collect()
        };
        for world in [1usize, 2, 3, 4] {
            let spans = [
                (2, Holder::Rank(0)),
                (3, Holder::Rank(world - 1)),
                (1, Holder::All),
                (3, Holder::Rank(world / 2)),
            ];
            let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
                let handles: Vec<_> = group(world)
                    .into_iter()
                    .map(|r| {
                        s.spawn(move || {
                            let mine: Vec<Vec<f32>> = (0..6)
                                .filter(|&i| r.owner(i, 6) == r.rank())
                                .map(values)
                                .collect();
                            let (mut whole, mut held) = (vec![0.0; 9], vec![7.0; 9]);
                            r.ordered_sum(&mine, &mut whole).unwrap();
                            r.ordered_sum_held(&mine, &spans, &mut held).unwrap();
                            (whole, held)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, (whole, held)) in results.iter().enumerate() {
                let mut at = 0;
                for &(len, h) in &spans {
                    for i in at..at + len {
                        let want = if h.holds(rank) { whole[i] } else { 0.0 };
                        assert_eq!(
                            held[i].to_bits(),
                            want.to_bits(),
                            "world {world} rank {rank} [{i}]"
                        );
                    }
                    at += len;
                }
            }
        }
    }

    #[test]
    fn a_failed_unit_stops_every_rank_with_its_message() {
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = group(3)
                .into_iter()
                .map(|r| {
                    s.spawn(move || {
                        match r.map_units(6, |i| if i == 4 { Err("bad unit") } else { Ok(vec![]) })
                        {
                            Err(super::super::UnitsError::Unit(e)) => format!("own: {e}"),
                            Err(super::super::UnitsError::Elsewhere { rank, what }) => {
                                format!("rank {rank}: {what}")
                            }
                            other => format!("{other:?}"),
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(errors[2], "own: bad unit");
        assert_eq!(errors[0], "rank 2: unit 4 of 6 failed: bad unit");
        assert_eq!(errors[1], errors[0]);
    }

    #[test]
    fn a_rank_that_stops_or_hangs_is_named() {
        let mut ranks = ThreadGroup::ranks(3, Duration::from_millis(300));
        let r2 = ranks.pop().unwrap();
        let r1 = ranks.pop().unwrap();
        let r0 = ranks.pop().unwrap();
        r2.fail("rank 2's step failed: out of memory");
        drop(r2);
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| r0.all_gather(vec![]));
            let b = s.spawn(|| r1.all_gather(vec![]));
            (a.join().unwrap(), b.join().unwrap())
        });
        let msg = a.unwrap_err().to_string();
        assert!(
            msg.contains("rank 2 stopped") && msg.contains("out of memory"),
            "{msg}"
        );
        assert!(matches!(b, Err(CollectiveError::RankGone { gone: 2, .. })));
        // a rank that never comes: a timeout naming it
        let ranks = ThreadGroup::ranks(2, Duration::from_millis(200));
        let e = ranks[0].all_gather(vec![]).unwrap_err();
        assert!(
            matches!(&e, CollectiveError::Timeout { missing, rank: 0, .. } if missing == &[1]),
            "{e}"
        );
        assert!(e.to_string().contains("ARES_COLLECTIVE_TIMEOUT"), "{e}");
    }
}
