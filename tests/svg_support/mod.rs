//! A strict SVG parse for the picture tests (tests/plan_svg.rs, tests/pictures.rs): matching
//! end tags, one root `svg`, only the predefined entities, every attribute well-formed.
#![allow(dead_code)]

use quick_xml::events::Event;
use std::collections::BTreeMap;

/// One element of the picture with its attributes and the text directly inside it.
#[derive(Debug)]
pub struct Element {
    pub name: String,
    pub attrs: BTreeMap<String, String>,
    pub text: String,
}

impl Element {
    pub fn attr(&self, key: &str) -> &str {
        self.attrs
            .get(key)
            .unwrap_or_else(|| panic!("{} has no {key}: {:?}", self.name, self.attrs))
    }

    pub fn num(&self, key: &str) -> u32 {
        self.attr(key).parse().unwrap()
    }

    pub fn class(&self) -> Option<&str> {
        self.attrs.get("class").map(String::as_str)
    }
}

/// Parses the whole document strictly and returns its elements in document order; `Err` says
/// where and why it is not well-formed.
pub fn try_parse(svg: &str) -> Result<Vec<Element>, String> {
    let mut reader = quick_xml::Reader::from_str(svg);
    reader.config_mut().check_end_names = true;
    let mut stack: Vec<(String, usize)> = Vec::new();
    let mut elements: Vec<Element> = Vec::new();
    let mut roots = 0;
    loop {
        let at = reader.buffer_position();
        let event = reader
            .read_event()
            .map_err(|e| format!("not well-formed at {at}: {e}"))?;
        match event {
            Event::Start(ref e) | Event::Empty(ref e) => {
                let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                if stack.is_empty() {
                    roots += 1;
                    if name != "svg" {
                        return Err(format!("the root element is {name}, not svg"));
                    }
                }
                let mut attrs = BTreeMap::new();
                for a in e.attributes() {
                    let a = a.map_err(|e| format!("a bad attribute in {name}: {e}"))?;
                    let value = a
                        .normalized_value(quick_xml::XmlVersion::Explicit1_0)
                        .map_err(|e| format!("a badly escaped value in {name}: {e}"))?
                        .into_owned();
                    attrs.insert(String::from_utf8_lossy(a.key.as_ref()).into_owned(), value);
                }
                elements.push(Element {
                    name: name.clone(),
                    attrs,
                    text: String::new(),
                });
                if matches!(event, Event::Start(_)) {
                    stack.push((name, elements.len() - 1));
                }
            }
            Event::End(e) => {
                let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                match stack.pop() {
                    Some((open, _)) if open == name => {}
                    other => return Err(format!("</{name}> closes {other:?}")),
                }
            }
            Event::GeneralRef(r) => {
                let name = r.decode().map_err(|e| e.to_string())?;
                if !(r.is_char_ref() || ["amp", "lt", "gt", "quot", "apos"].contains(&&*name)) {
                    return Err(format!("undefined entity &{name};"));
                }
                if let Some((_, i)) = stack.last() {
                    elements[*i].text.push('&');
                }
            }
            Event::Text(t) => {
                let text = t.decode().map_err(|e| e.to_string())?;
                match stack.last() {
                    Some((_, i)) => elements[*i].text.push_str(&text),
                    None if text.trim().is_empty() => {}
                    None => return Err("text outside the root".into()),
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if !stack.is_empty() {
        return Err(format!("unclosed elements: {stack:?}"));
    }
    if roots != 1 {
        return Err(format!("{roots} root elements"));
    }
    Ok(elements)
}

/// [`try_parse`], panicking with the reason.
pub fn parse(svg: &str) -> Vec<Element> {
    try_parse(svg).unwrap_or_else(|e| panic!("{e}"))
}
