//! Every bound the fetcher holds a Hub (or whatever answers at `HF_ENDPOINT`) to, in one
//! place: a listing is read into memory, so its size is capped before it is parsed.

/// Longest `org` or `name` of a repository (the Hub's own limit is 96).
pub const MAX_NAME_PART: usize = 96;

/// Longest revision (branch, tag or commit) a model argument may name.
pub const MAX_REVISION: usize = 256;

/// Most bytes of a repository listing (`/api/models/…?blobs=true`) read; a listing of
/// 10,000 files is about 2 MiB.
pub const MAX_LISTING_BYTES: u64 = 16 << 20;

/// Most file names an error message lists.
pub const LISTED_CHOICES: usize = 20;

/// Retries of a file whose transfer broke, each resuming where the last stopped.
pub const DOWNLOAD_RETRIES: usize = 3;

/// Seconds between progress lines when stderr is not a terminal.
pub const LOG_EVERY_SECS: u64 = 10;
