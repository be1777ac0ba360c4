//! AI provider dispatch: the generic async-job API ([`api`]), the trait spindle dispatches
//! through and its HTTP adapter ([`adapter`]), adapters for real vendors' APIs and local
//! stand-ins of them ([`vendors`]), callback signatures ([`signature`]), signed webhooks ([`webhook`]) and a receiver of them ([`receiver`]), and the mock
//! provider ([`mock`], binary `spindle-mock-provider`); outbound HTTPS through [`tls`]; uploads
//! to S3-compatible storage ([`object_store`]), with keys from STS for a Kubernetes service
//! account ([`sts`]) or from an EC2 instance's metadata service ([`imds`]), and stand-ins for
//! the bucket, STS and the metadata service that check what they are sent ([`fake_s3`],
//! [`fake_sts`], [`fake_imds`]).

pub mod adapter;
pub mod api;
pub mod fake_imds;
pub mod fake_s3;
pub mod fake_sts;
pub mod imds;
pub mod mock;
pub mod object_store;
pub mod receiver;
mod serve;
pub mod signature;
pub mod sources;
pub mod sts;
pub mod temporary_keys;
pub mod tls;
pub mod vendors;
pub mod webhook;

pub use adapter::{
    download, download_from, AsyncJobProvider, FetchError, HttpProvider, Lookup, QueryError,
    Submission, SubmitError,
};
pub use api::{Fault, JobState, JobView, ProblemKind, Stats};
pub use mock::{AccountSpec, MockConfig, MockProvider};
pub use receiver::{EventReceiver, Received, ReceiverStats};
pub use tls::TlsError;
pub use vendors::{Provider, Vendor};
pub use webhook::{Webhook, WebhookError};
