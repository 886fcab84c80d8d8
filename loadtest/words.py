"""Common English words that BPE vocabularies (GPT-2, Llama 3, SmolLM, Qwen) hold as one token each
when preceded by a space, so a prompt of N such words is close to N tokens without a tokenizer."""

_TEXT = """
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community
name president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment air teacher
force education foot boy age policy music market sense nation plan college interest death experience
effect class control care field development role effort rate heart drug show leader light voice wife
police mind price report decision son view relationship town road arm difference value building action
model season society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure street
image phone data picture practice piece land product doctor wall patient worker news test movie north
love support technology step baby computer type attention film tree source organization hair window
evidence population site nature training method rule network sound fish thought energy glass
be have do say go get make know think take see come want look use find give tell call try ask feel
leave put mean keep let begin seem help talk turn start show hear play run move like live believe hold
bring happen write provide sit stand lose pay meet include continue set learn lead understand watch
follow stop create speak read allow add spend grow open walk win offer remember consider appear buy
wait serve die send expect build stay fall cut reach kill remain suggest raise pass sell require
report decide pull good new first last long great little own other old big high different small large
next early young important few public bad same able late hard major better economic strong possible
whole free military true federal international full special easy clear recent certain personal open
red difficult available likely short single medical current wrong private past foreign fine common
poor natural significant similar hot dead central happy serious ready simple left physical general
environmental financial blue democratic dark various entire close legal religious cold final main green
nice huge popular traditional cultural
"""
WORDS = tuple(dict.fromkeys(_TEXT.split()))
