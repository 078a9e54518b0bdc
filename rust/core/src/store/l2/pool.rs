//! [`IoPool`]: a few named threads and a bounded FIFO queue, for L2
//! write-behind, reads and deletes, so file I/O never runs under the service
//! lock. Jobs are plain closures; a job that panics is logged and does not
//! take its thread down.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// A unit of work for an [`IoPool`].
pub type Job = Box<dyn FnOnce() + Send + 'static>;

struct State {
    queue: VecDeque<Job>,
    running: usize,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued or shutdown begins (workers wait here).
    work: Condvar,
    /// Signalled when a queued job is taken (blocking submitters wait here).
    space: Condvar,
    /// Signalled when the pool becomes idle (no queued, no running jobs).
    idle: Condvar,
    bound: usize,
}

/// A bounded work queue served by a fixed set of threads named `<name>-<i>`.
///
/// Dropping the pool (or [`IoPool::shutdown`]) runs every job already queued,
/// then joins the threads. A job must not block on submitting to its own
/// pool (with every thread doing so, nothing would drain the queue).
pub struct IoPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    name: String,
}

impl std::fmt::Debug for IoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoPool")
            .field("name", &self.name)
            .field("threads", &self.threads.len())
            .field("bound", &self.shared.bound)
            .field("queued", &self.queued())
            .finish()
    }
}

impl IoPool {
    /// Starts `threads` threads serving a queue of at most `queue_bound`
    /// waiting jobs. Both must be at least 1.
    pub fn new(threads: usize, queue_bound: usize, name: &str) -> Result<IoPool> {
        if threads == 0 {
            return Err(Error::invalid(format!(
                "I/O pool {name:?} needs at least one thread"
            )));
        }
        if queue_bound == 0 {
            return Err(Error::invalid(format!(
                "I/O pool {name:?} needs a queue bound of at least 1"
            )));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::with_capacity(queue_bound.min(4096)),
                running: 0,
                shutdown: false,
            }),
            work: Condvar::new(),
            space: Condvar::new(),
            idle: Condvar::new(),
            bound: queue_bound,
        });
        // Built before spawning, so a failed spawn drops (and joins) the
        // threads already started.
        let mut pool = IoPool {
            shared,
            threads: Vec::with_capacity(threads),
            name: name.to_string(),
        };
        for i in 0..threads {
            let thread_name = format!("{name}-{i}");
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(thread_name.clone())
                .spawn(move || worker(&shared, &thread_name))
                .map_err(|e| Error::io(format!("spawn I/O thread {name}-{i}"), e))?;
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    /// Queues `job` unless the queue already holds `queue_bound` waiting
    /// jobs, in which case the job is handed back.
    pub fn try_submit(&self, job: Job) -> std::result::Result<(), Job> {
        let mut s = self.shared.state.lock();
        if s.shutdown || s.queue.len() >= self.shared.bound {
            return Err(job);
        }
        s.queue.push_back(job);
        drop(s);
        self.shared.work.notify_one();
        Ok(())
    }

    /// Queues `job`, waiting for room in the queue if it is full.
    pub fn submit_blocking(&self, job: Job) {
        let mut s = self.shared.state.lock();
        while s.queue.len() >= self.shared.bound && !s.shutdown {
            self.shared.space.wait(&mut s);
        }
        s.queue.push_back(job);
        drop(s);
        self.shared.work.notify_one();
    }

    /// Jobs waiting plus jobs running.
    pub fn queued(&self) -> usize {
        let s = self.shared.state.lock();
        s.queue.len() + s.running
    }

    /// The number of threads.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// The pool's name (its threads are `<name>-<i>`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits until no job is queued or running; false if `timeout` passed first.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut s = self.shared.state.lock();
        while !s.queue.is_empty() || s.running > 0 {
            match deadline {
                Some(d) => {
                    if self.shared.idle.wait_until(&mut s, d).timed_out() {
                        return s.queue.is_empty() && s.running == 0;
                    }
                }
                None => self.shared.idle.wait(&mut s),
            }
        }
        true
    }

    /// Runs every queued job, then stops and joins the threads.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.work.notify_all();
        self.shared.space.notify_all();
        for handle in self.threads.drain(..) {
            // Jobs run under catch_unwind, so a worker only ends in error if
            // the pool's own code panicked; nothing is left to clean up then.
            if handle.join().is_err() {
                log::error!("I/O pool {}: a worker thread panicked", self.name);
            }
        }
    }
}

fn worker(shared: &Shared, thread_name: &str) {
    let mut s = shared.state.lock();
    loop {
        if let Some(job) = s.queue.pop_front() {
            s.running += 1;
            drop(s);
            shared.space.notify_one();
            if let Err(panic) = catch_unwind(AssertUnwindSafe(job)) {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|m| (*m).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic payload".to_string());
                log::error!("{thread_name}: I/O job panicked: {what}");
            }
            s = shared.state.lock();
            s.running -= 1;
            if s.queue.is_empty() && s.running == 0 {
                shared.idle.notify_all();
            }
        } else if s.shutdown {
            return;
        } else {
            shared.work.wait(&mut s);
        }
    }
}
