//! The cluster's policy for worker pods (allowed ServiceAccounts, images, and what a pod
//! template may set), checked before any pod is built.

use super::*;

/// The ServiceAccount a worker pod runs as when spec.podTemplate.serviceAccountName is unset:
/// always allowed by a [`PodPolicy`].
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// What the operator lets a StreamJob ask for beyond the spec's own rules: which images
/// (spec.image) and ServiceAccounts (spec.podTemplate.serviceAccountName) its workers may run
/// with. An empty list allows any. The operator's own worker image (used when spec.image is
/// unset) and the namespace's `default` ServiceAccount are always allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodPolicy {
    /// spec.image must start with one of these (write them up to a `/`, `:` or `@`, e.g.
    /// `registry.example.com/streaming/`, or a prefix also admits look-alike registries).
    pub allowed_image_prefixes: Vec<String>,
    /// spec.podTemplate.serviceAccountName must be one of these.
    pub allowed_service_accounts: Vec<String>,
}

/// A job the operator's [`PodPolicy`] refuses: names the field, what is allowed, and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "spec.image `{image}` is not allowed here: this operator runs only images starting with {allowed}; use such an image, remove spec.image to run the operator's worker image, or ask the cluster admin to extend policy.allowedImagePrefixes"
    )]
    ImageNotAllowed { image: String, allowed: String },
    #[error(
        "spec.podTemplate.serviceAccountName `{account}` is not allowed here: this operator runs workers only as {allowed} (or the namespace's default); name one of them, remove the field to use the default ServiceAccount, or ask the cluster admin to extend policy.allowedServiceAccounts"
    )]
    ServiceAccountNotAllowed { account: String, allowed: String },
}

impl PolicyError {
    /// The reason of the Stalled condition.
    pub fn reason(&self) -> keyshift_core::reason::Reason {
        use keyshift_core::reason::Reason;
        match self {
            PolicyError::ImageNotAllowed { .. } => Reason::ImageNotAllowed,
            PolicyError::ServiceAccountNotAllowed { .. } => Reason::ServiceAccountNotAllowed,
        }
    }
}

pub(super) fn quoted_list(items: &[String]) -> String {
    items
        .iter()
        .map(|i| format!("`{i}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `policy` lets `spec` run; `worker_image` is the operator's own worker image (the one
/// used when spec.image is unset), always allowed.
pub fn check_pod_policy(
    spec: &StreamJobSpec,
    policy: &PodPolicy,
    worker_image: &str,
) -> Result<(), PolicyError> {
    if let Some(image) = &spec.image
        && !policy.allowed_image_prefixes.is_empty()
        && image != worker_image
        && !policy
            .allowed_image_prefixes
            .iter()
            .any(|p| !p.is_empty() && image.starts_with(p.as_str()))
    {
        return Err(PolicyError::ImageNotAllowed {
            image: image.clone(),
            allowed: quoted_list(&policy.allowed_image_prefixes),
        });
    }
    if let Some(account) = spec
        .pod_template
        .as_ref()
        .and_then(|t| t.service_account_name.as_ref())
        && !policy.allowed_service_accounts.is_empty()
        && account != DEFAULT_SERVICE_ACCOUNT
        && !policy.allowed_service_accounts.contains(account)
    {
        return Err(PolicyError::ServiceAccountNotAllowed {
            account: account.clone(),
            allowed: quoted_list(&policy.allowed_service_accounts),
        });
    }
    Ok(())
}
