//! The map-state program the benchmarks measure (bring-your-own-job issue, item 6: "a job with
//! map state"): per key, a map of `fields` attributes (field -> a payload of `payload` bytes).
//! It reads generated records as a program reads them (`{"key","value","ts"}`): a record sets
//! its key's field `value mod fields` to a payload whose bytes say `value div fields`, so that
//! a later record for the same field changes the entry. `keyshift bench checkpoint --program`
//! feeds it directly; keyshift's worker carries it (with the `bench` feature, shaped by
//! [`FIELDS`] and [`PAYLOAD`]) for `keyshift bench rescale --program`.

use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};

/// The program's name, in `spec.job.program.name` and in its state's identity.
pub(crate) const NAME: &str = "attributes";
/// Entries per key of the program keyshift's worker carries.
pub(crate) const FIELDS: u32 = 4;
/// Bytes of each entry's payload in the program keyshift's worker carries: with [`FIELDS`],
/// about the 400 bytes per key the other benches' state holds.
pub(crate) const PAYLOAD: usize = 90;

/// A generated record, as keyshift's generator hands it to a program.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Generated {
    pub key: String,
    pub value: i64,
    #[serde(default)]
    pub ts: i64,
}

/// The keyed step: per key, field -> payload.
struct Attributes {
    fields: u32,
    payload: usize,
}

impl KeyedProcessFunction for Attributes {
    type Key = String;
    type In = Generated;
    type Out = String;
    type State = MapHandle<u32, String>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.map(MapStateDescriptor::new("attributes"))
    }

    fn process(
        &mut self,
        r: Generated,
        attributes: &Self::State,
        ctx: &mut Context<'_, String, String>,
    ) -> keyshift_sdk::Result<()> {
        let fields = i64::from(self.fields.max(1));
        let field = r.value.rem_euclid(fields) as u32;
        let fill = char::from(b'a' + r.value.div_euclid(fields).rem_euclid(26) as u8);
        let payload = std::iter::repeat_n(fill, self.payload).collect();
        Ok(ctx.map(attributes).insert(&field, payload)?)
    }
}

/// The program: generated records from source `in`, keyed by their key.
pub(crate) fn job(fields: u32, payload: usize) -> Job {
    Job::json_lines::<Generated>(NAME, "in", |r| r.ts)
        .key_by(|r| r.key.clone())
        .process(NAME, move || Attributes { fields, payload })
        .to_json_lines("out")
}

/// The value of a record that sets `field` in its `round`'s payload.
pub(crate) fn value(field: u32, round: u32, fields: u32) -> i64 {
    i64::from(round) * i64::from(fields.max(1)) + i64::from(field)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keyshift_core::keygroup::GroupMode;
    use keyshift_core::keygroup::KeyGroupRange;
    use keyshift_sdk::block::describe;
    use keyshift_sdk::key::StreamKey;

    #[test]
    fn a_record_sets_its_field_to_its_rounds_payload() {
        let range = KeyGroupRange { start: 0, end: 127 };
        let attributes = Attributes {
            fields: 4,
            payload: 3,
        };
        let mut op = KeyedOperator::new(NAME, attributes, 128, range).unwrap();
        let key = "u".to_owned();
        for (field, round) in [(1, 0), (2, 0), (1, 2)] {
            let r = Generated {
                key: key.clone(),
                value: value(field, round, 4),
                ts: 0,
            };
            op.process(&key, 0, r).unwrap();
        }
        let group = key.record_key().key_group(128);
        op.cut();
        let block = op.encode_group(group, GroupMode::Full).unwrap().unwrap();
        let (_, entries) = describe(&block.bytes).unwrap();
        let mut values: Vec<_> = entries
            .iter()
            .map(|e| e.value_hex.clone().unwrap_or_default())
            .collect();
        values.sort();
        // Field 1 holds round 2's payload ("ccc"), field 2 round 0's ("aaa").
        assert_eq!(values.len(), 2, "{entries:?}");
        assert!(values[0].ends_with("616161"), "{values:?}");
        assert!(values[1].ends_with("636363"), "{values:?}");
    }
}
