"""The research: the papers' mechanisms measured (mechanisms), the three methods compared at an equal budget
(study), speed and memory (benchmark), and the helpers the scripts under results/ share. Run each as
`python -m research.<module> ...` from the repository root."""
