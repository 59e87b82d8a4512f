// quantem.gpu browse page
