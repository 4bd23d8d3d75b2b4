//! Work too long for the threads that serve connections (parsing a large body, compiling a
//! grammar), run on the blocking pool at most a fixed number at a time. Each piece of work
//! holds its turn until it ends, also when its caller stops waiting (a client that left):
//! blocking work cannot be cancelled, so freeing the turn early would let clients that
//! connect and leave start any number of them.

use std::sync::Arc;

use tokio::sync::Semaphore;

/// Turns on the blocking pool.
#[derive(Debug, Clone)]
pub struct Turns(Arc<Semaphore>);

/// Why work could not run to its end.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    #[error("no more turns are given: the process is stopping")]
    Closed,
    #[error("the work failed: {0}")]
    Failed(String),
}

impl Turns {
    /// `n` turns (at least one).
    pub fn new(n: usize) -> Self {
        Self(Arc::new(Semaphore::new(n.max(1))))
    }

    /// Turns free now.
    pub fn free(&self) -> usize {
        self.0.available_permits()
    }

    /// Runs `work` on the blocking pool once a turn is free, in the current span. The work
    /// holds the turn until it returns; dropping this future before it starts gives up the
    /// wait, after that it only stops waiting for the result.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, TurnError> {
        let turn = Arc::clone(&self.0)
            .acquire_owned()
            .await
            .map_err(|_| TurnError::Closed)?;
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            span.in_scope(work)
        })
        .await
        .map_err(|e| TurnError::Failed(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_keeps_its_turn_after_its_caller_leaves() {
        let turns = Turns::new(1);
        let (started_tx, started) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let caller = {
            let turns = turns.clone();
            tokio::spawn(async move {
                turns
                    .run(move || {
                        started_tx.send(()).unwrap();
                        released.recv().unwrap();
                    })
                    .await
            })
        };
        tokio::task::spawn_blocking(move || started.recv().unwrap())
            .await
            .unwrap();
        // The caller leaves while its work runs: the turn stays taken.
        caller.abort();
        assert!(caller.await.unwrap_err().is_cancelled());
        assert_eq!(turns.free(), 0, "the running work still holds its turn");
        release.send(()).unwrap();
        // The work ends and gives its turn back; a new caller gets it.
        let second = turns.run(|| 7).await.unwrap();
        assert_eq!(second, 7);
        assert_eq!(turns.free(), 1);
    }
}
